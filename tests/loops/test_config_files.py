"""Mounted config files followed the way a ConfigMap update replaces them (symlink swap)."""

from __future__ import annotations

import os
from pathlib import Path

from meshd.decisions.placement.constraints import TypeConstraints
from meshd.loops.config_files import FileWatch


def _configmap(root: Path, version: str, text: str) -> None:
    """What the kubelet does: files in a fresh `..<version>` directory, then the `..data`
    symlink swapped to it in one rename; the mounted file is a symlink through `..data`."""
    data = root / f"..{version}"
    data.mkdir()
    (data / "type_constraints").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, root / "..data")
    link = root / "type_constraints"
    if not link.is_symlink():
        link.symlink_to("..data/type_constraints")


def test_symlink_swap_is_applied_and_a_bad_update_keeps_the_previous(tmp_path: Path) -> None:
    _configmap(tmp_path, "v1", '{"mt:a": {"required": ["mt:a"]}}')
    applied: list[TypeConstraints] = []
    watch = FileWatch(
        "MM_TYPE_CONSTRAINTS_PATH", tmp_path / "type_constraints", lambda t: applied.append(TypeConstraints.parse(t))
    )
    assert not watch.check()  # start-up's content: nothing new
    _configmap(tmp_path, "v2", '{"mt:b": {"required": ["mt:b"]}}')
    assert watch.check() and applied[-1].for_type("mt:b")[0] == {"mt:b"}
    assert not watch.check()  # once
    _configmap(tmp_path, "v3", "{not json")
    assert not watch.check() and len(applied) == 1  # kept the previous
    _configmap(tmp_path, "v4", '{"_default": {"required": ["_no_runtime"]}}')
    assert watch.check() and applied[-1].for_type("x")[0] == {"_no_runtime"} and watch.changes == 2


def test_a_missing_file_mid_swap_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "dp.json"
    path.write_text("{}")
    seen: list[str] = []
    watch = FileWatch("MM_DATAPLANE_CONFIG_PATH", path, seen.append)
    path.unlink()
    assert not watch.check() and seen == []
    path.write_text('{"allowOtherRpcs": false}')
    assert watch.check() and seen == ['{"allowOtherRpcs": false}']
