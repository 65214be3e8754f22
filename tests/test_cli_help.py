"""Every `meshd` command's --help renders (argparse formats help text with %)."""

from __future__ import annotations

import argparse

import pytest

from meshd.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*prefix, name))
    return found


COMMANDS = _commands(build_parser())


def test_the_commands_are_found() -> None:
    assert {("serve",), ("models", "register"), ("vmodels", "set"), ("instances", "list")} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "meshd")
def test_help_renders(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "Traceback" not in out


def test_the_summaries_name_real_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    """`meshd --help` says what each command group does in words: every verb it names is one
    the group takes (issue 45: it said `show`, which was refused)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    summary = capsys.readouterr().out
    for group in ("models", "vmodels"):
        line = next(line for line in summary.splitlines() if line.split()[:1] == [group])
        words = set(line.replace(",", " ").replace("(", " ").replace(")", " ").split()[1:])
        verbs = {c[1] for c in COMMANDS if len(c) == 2 and c[0] == group}
        named = words - {"and", "or", group}
        assert named <= verbs, (group, named - verbs)
        assert {"get", "show"} <= named


def test_show_is_get() -> None:
    for command in (["models", "show", "m"], ["vmodels", "show", "v"]):
        args = build_parser().parse_args(command)
        assert args.func is not None
        assert getattr(args, "model_id", None) == "m" or getattr(args, "vmodel_id", None) == "v"
