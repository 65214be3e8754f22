"""Arguments of `meshd models|vmodels|instances`, and their errors, without a mesh."""

from __future__ import annotations

import pytest

from meshd.cli import build_parser, main
from meshd.ops.connect import DEFAULT_TIMEOUT_S
from meshd.testing.procs import free_port


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_common_options_follow_each_command() -> None:
    args = build_parser().parse_args(["models", "list"])
    assert (args.address, args.timeout, args.json) == (None, DEFAULT_TIMEOUT_S, False)
    args = build_parser().parse_args(["instances", "list", "--address", "mesh:1", "--timeout", "2.5", "--json"])
    assert (args.address, args.timeout, args.json) == ("mesh:1", 2.5, True)


def test_register_arguments() -> None:
    args = build_parser().parse_args(
        ["models", "register", "m1", "--type", "demo", "--path", "/p", "--key", "{}", "--load-now", "--sync"]
    )
    assert (args.model_id, args.model_type, args.path, args.key, args.load_now, args.sync) == (
        "m1",
        "demo",
        "/p",
        "{}",
        True,
        True,
    )
    assert args.last_used_ms == 0


def test_vmodel_set_arguments() -> None:
    argv = ["vmodels", "set", "vm", "m2", "--auto-delete", "--force", "--owner", "o", "--expected-target", "m1"]
    args = build_parser().parse_args(argv)
    assert (args.vmodel_id, args.target, args.model_type, args.auto_delete, args.force) == (
        "vm",
        "m2",
        None,
        True,
        True,
    )
    assert (args.owner, args.expected_target, args.load_now, args.sync, args.update_only) == (
        "o",
        "m1",
        False,
        False,
        False,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["models"], "required"),
        (["models", "register", "m1"], "the following arguments are required: --type"),
        (["models", "list", "--timeout", "0"], "must be more than 0"),
        (["models", "list", "--timeout", "soon"], "not a number of seconds"),
        (["models", "list", "--address", " "], "must not be empty"),
        (["models", "register", "m1", "--type", "t", "--last-used-ms", "-1"], "must not be negative"),
        (["models", "register", "m1", "--type", "t", "--last-used-ms", str(1 << 63)], "must be at most 9223"),
        (["vmodels", "set", "vm"], "required: TARGET_MODEL_ID"),
        (["vmodels", "set", "vm", "m1", "--key", "k"], "give --type too"),
        (["instances", "show"], "invalid choice"),
        # argv bytes that are not UTF-8 (Python hands them on as lone surrogates)
        (["models", "get", "\udcff"], "not valid UTF-8"),
        (["vmodels", "set", "vm", "\udcff"], "not valid UTF-8"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in usage_error(argv, capsys)


def test_an_unreachable_mesh_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    assert main(["vmodels", "get", "vm", "--address", address]) == 1
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == f"meshd vmodels get: cannot reach meshd at {address} (connection refused)\n"


def test_the_address_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("MESHD_ADDRESS", address)
    assert main(["instances", "list", "--json"]) == 1
    assert capsys.readouterr().err == f"meshd instances list: cannot reach meshd at {address} (connection refused)\n"


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("localhost", "has no port; meshd's gRPC port is 8033 by default: localhost:8033"),
        ("http://localhost:8033", "is a URL; give host:port of meshd's gRPC port, e.g. localhost:8033"),
        ("https://mesh.example", "e.g. mesh.example:8033"),
        ("localhost:http", "the port must be a number"),
        ("localhost:70000", "the port must be a number from 1 to 65535"),
    ],
)
def test_addresses_that_cannot_work_say_what_to_write(
    address: str, message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert message in usage_error(["models", "list", "--address", address], capsys)
    monkeypatch.setenv("MESHD_ADDRESS", address)
    assert main(["models", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshd models list: $MESHD_ADDRESS: ") and message in err


@pytest.mark.parametrize("address", ["localhost:8033", "10.0.0.1:1", "[::1]:8033", "unix:/tmp/meshd.sock"])
def test_addresses_that_work(address: str) -> None:
    assert build_parser().parse_args(["models", "list", "--address", address]).address == address
