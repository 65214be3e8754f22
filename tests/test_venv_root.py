"""Where the engine and client venvs are built: a checkout's `.venvs`, never inside an installed
meshd's site-packages (issue 45: `meshd demo --runtime llamacpp` wrote 190 MB there)."""

from __future__ import annotations

from pathlib import Path

from meshd.testing.venvs import DEFAULT_ROOT, default_root


def test_a_checkout_keeps_its_venvs_beside_the_code(tmp_path: Path) -> None:
    (tmp_path / "meshd").mkdir()
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    assert default_root(tmp_path, {}) == tmp_path / ".venvs"
    assert DEFAULT_ROOT == Path(__file__).resolve().parents[1] / ".venvs"  # this checkout


def test_an_installed_meshd_builds_them_in_the_users_cache(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "meshd").mkdir(parents=True)
    assert default_root(site, {"XDG_CACHE_HOME": str(tmp_path / "cache")}) == tmp_path / "cache" / "meshd" / "venvs"
    assert default_root(site, {}) == Path.home() / ".cache" / "meshd" / "venvs"
