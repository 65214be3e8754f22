"""meshd: a Python model mesh beside any ModelMesh runtime."""

__version__ = "0.1.0"
