"""`meshd pull`: a model pulled as a load would, printed as JSON; errors as one clear line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.storage.cli import add_arguments, settings_from_args
from meshd.testing.objserver import ObjectServer


def pull(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshd", "pull", *argv], capture_output=True, text=True, timeout=60)


def test_meshd_pull_then_inventory(tmp_path: Path) -> None:
    (tmp_path / "srv" / "bkt").mkdir(parents=True)
    (tmp_path / "srv" / "bkt" / "m.bin").write_bytes(b"w" * 1000)
    (tmp_path / "cfg").mkdir()
    with ObjectServer(tmp_path / "srv") as srv:
        entry = {"type": "s3", "endpoint_url": srv.url, "bucket": "bkt", "anonymous": "true"}
        (tmp_path / "cfg" / "k").write_text(json.dumps(entry))
        where = ("--model-dir", str(tmp_path / "models"), "--storage-config", str(tmp_path / "cfg"))
        got = pull("m1", "m.bin", "--key", '{"storage_key": "k", "model_type": "x"}', *where)
        assert got.returncode == 0, got.stderr
        out = json.loads(got.stdout)
        assert out["local_path"] == str(tmp_path / "models" / "m1" / "m.bin") and out["disk_size_bytes"] == 1000
        assert json.loads(out["key"]) == {"model_type": "x", "disk_size_bytes": 1000}
        inv = json.loads(pull("--inventory", *where).stdout)
        assert [m["model_id"] for m in inv["models"]] == ["m1"] and inv["used_bytes"] == 1000
        bad = pull("m2", "m.bin", "--key", '{"storage_key": "absent"}', *where)
        assert bad.returncode == 1 and "Did not find storage config for key 'absent'" in bad.stderr
        assert "Traceback" not in bad.stderr
        worse = pull("m2", "m.bin", *where, "--disk-cache-bytes", "12")
        assert worse.returncode != 0 and "MESHD_DISK_CACHE_BYTES" in worse.stderr and "Traceback" not in worse.stderr


def test_pull_objects_flag_fixes_the_workers_or_leaves_them_to_adapt() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args([]), env={}).objects_in_flight == 0  # adapted
    assert settings_from_args(parser.parse_args([]), env={"MESHD_PULL_OBJECTS": "8"}).objects_in_flight == 8
    assert settings_from_args(parser.parse_args(["--pull-objects", "16"]), env={}).objects_in_flight == 16
    with pytest.raises(SystemExit, match="MESHD_PULL_OBJECTS must be 0"):
        settings_from_args(parser.parse_args(["--pull-objects", "-1"]), env={})
