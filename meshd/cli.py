"""`meshd` command line: serve, demo, runtime (the reference runtime), gen-models, and the
operator commands models, vmodels and instances (meshd.ops)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from meshd import __version__
from meshd.config import ConfigError, add_serve_arguments, load_config
from meshd.observability.logs import setup_logging


def _run(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # measured: ~9-15 % less proxy CPU than the default loop
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]


def _serve(args: argparse.Namespace) -> int:
    from meshd.mesh import StartRefused, serve
    from meshd.runtime.client import RuntimeNotReady

    try:
        config = load_config(args)
    except ConfigError as e:
        print(f"meshd serve: {e}", file=sys.stderr)
        return 2
    setup_logging(args.log_level, config.log_format)
    try:
        _run(serve(config))
    except StartRefused as e:  # nothing was changed: a setting to fix, like a bad value
        print(f"meshd serve: {e}", file=sys.stderr)
        return 2
    except RuntimeNotReady as e:
        print(f"meshd serve: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"meshd serve: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a clear line, not a traceback, for start-up failures
        from meshd.kv.store import StoreError

        if isinstance(e, StoreError):
            print(f"meshd serve: {e}", file=sys.stderr)
            return 1
        raise
    return 0


def _stop(args: argparse.Namespace) -> int:
    """`meshd stop [wait]` (what the image's /opt/kserve/mmesh/stop.sh runs): asks the local
    instance to shut down through its /prestop endpoint, the same drain SIGTERM starts; with
    `wait`, returns only once it has stopped (the mm container's preStop hook)."""
    import os
    import urllib.error
    import urllib.request

    port = os.environ.get("MM_PRESTOP_WAIT_PORT") or "8090"
    url = f"http://127.0.0.1:{port}/prestop"
    wait = args.mode == "wait"
    budget_s = int(os.environ.get("SHUTDOWN_TIMEOUT_MS") or "30000") / 1000 + 10
    try:
        with urllib.request.urlopen(url, timeout=budget_s if wait else 2.0) as resp:
            answer = resp.read().decode(errors="replace").split()
        if wait and len(answer) == 2 and answer[1].isdigit():  # "STOPPED <pid>": wait for the exit too
            _wait_gone(int(answer[1]), EXIT_WAIT_S)
    except TimeoutError:
        if wait:
            print(f"meshd stop: no answer from {url} within {budget_s:.0f} s", file=sys.stderr)
            return 1
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        # Nothing listening (not started, or gone already) or the connection closed as it
        # exited: there is nothing left to stop.
        print(f"meshd stop: {url}: {getattr(e, 'reason', e)} (instance not running)", file=sys.stderr)
    return 0


EXIT_WAIT_S = 10.0  # a stopped instance exits in a fraction of a second


def _wait_gone(pid: int, limit_s: float) -> None:
    """Return once process `pid` has exited (or after `limit_s`); a pid this namespace does not
    see counts as gone."""
    import os
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass  # exists, someone else's
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return  # exited, not yet reaped by its parent
        except (OSError, IndexError):
            pass
        time.sleep(0.02)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshd", description="A Python model mesh beside any ModelMesh runtime.")
    parser.add_argument("--version", action="version", version=f"meshd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one meshd instance beside a runtime")
    add_serve_arguments(serve)
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)

    stop = sub.add_parser("stop", help="ask the local instance to drain and stop (/prestop); 'wait': until it has")
    stop.add_argument("mode", nargs="?", choices=["wait"], help="wait until the instance has stopped")
    stop.set_defaults(func=_stop)

    demo = sub.add_parser("demo", help="run a self-contained mesh with reference runtimes and drive traffic")
    from meshd.demo import add_demo_arguments, run_demo

    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo)

    runtime = sub.add_parser("runtime", help="run the reference (demo) runtime", add_help=False)
    runtime.set_defaults(func=None)
    adapter = sub.add_parser("adapter", help="run the ModelRuntime adapter for Triton or MLServer", add_help=False)
    adapter.set_defaults(func=None)
    llm = sub.add_parser("llm-runtime", help="run OpenAI-compatible LLM engines as a ModelRuntime", add_help=False)
    llm.set_defaults(func=None)
    gen = sub.add_parser("gen-models", help="write a set of demo model files", add_help=False)
    gen.set_defaults(func=None)
    pull = sub.add_parser(
        "pull", help="pull a model from its store onto local disk, or list the disk tier", add_help=False
    )
    pull.set_defaults(func=None)
    from meshd.ops.commands import add_commands

    add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # These own their flags; pass the rest through untouched.
    if argv and argv[0] == "runtime":
        from meshd.runtimes.demo import main as runtime_main

        return runtime_main(argv[1:])
    if argv and argv[0] == "llm-runtime":
        from meshd.adapter.llm.main import main as llm_main

        return llm_main(argv[1:])
    if argv and argv[0] == "adapter":
        from meshd.adapter.main import main as adapter_main

        return adapter_main(argv[1:])
    if argv and argv[0] == "pull":
        from meshd.storage.cli import main as pull_main

        return pull_main(argv[1:])
    if argv and argv[0] == "gen-models":
        from meshd.runtimes.models import main as gen_main

        return gen_main(argv[1:])
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
