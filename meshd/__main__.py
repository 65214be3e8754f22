"""`python -m meshd` is the `meshd` command."""

import sys

from meshd.cli import main

sys.exit(main())
