"""A private network of Linux network namespaces for network-fault tests (root only).

`NetLab` gives each host (an etcd member, a meshd with its runtime) its own namespace with
one interface, `eth0`, joined by a veth pair to a bridge that lives in a namespace of its
own. The test process reaches the hosts through one more veth pair from the root namespace
(the "observer" address, never cut). Addresses are in 198.18.0.0/24 (the benchmarking
range); no namespace has a default route or NAT, so nothing leaves the lab.

Faults, with `ip` and `tc` only (no nftables/iptables, and no `sch_netem` or `act_gact`,
which small VM kernels often lack):

- `block(dst, srcs)`: `dst` silently drops IP packets from `srcs` on arrival (a classic-BPF
  `cls_bpf` filter in direct-action mode on its ingress; a rule may name one TCP port). Both
  directions of a cut are two blocks; "can send, not receive" is one.
- `shape(host, delay_ms, loss)`: the host's bridge port is taken off the bridge and a
  userspace forwarder (`meshd.testing.shaper`) carries its frames, each direction delayed and
  a fraction dropped, until `unshape`.

Every name starts with `mnf<pid>`: `sweep()` removes the leftovers of runs whose process is
gone (their processes by PID, their namespaces and root-namespace links), and `close()`
removes this run's, whatever state a test left behind. One lab at a time per machine (a lock
file): the observer address is the same for every run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshd.testing.procs import Child, Children

PREFIX = "mnf"
SUBNET = "198.18.0"
OBSERVER_ADDR = f"{SUBNET}.1"
LOCK_PATH = Path("/run/lock/meshd-netfaults.lock")
_BR = "br0"

# cBPF: the packet starts at the Ethernet header (cls_bpf pushes it back on ingress).
_LD_H_ABS, _LD_W_ABS, _LD_B_ABS, _LDX_MSH, _LD_H_IND = 0x28, 0x20, 0x30, 0xB1, 0x48
_JEQ, _RET = 0x15, 0x06
_TC_ACT_SHOT, _TC_ACT_UNSPEC = 2, 0xFFFFFFFF  # drop; "no verdict", the packet goes on


class LabUnavailable(RuntimeError):
    """Not root, or `ip`/`tc`/namespaces are missing: the tests skip with this reason."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _ip4(addr: str) -> int:
    a, b, c, d = (int(x) for x in addr.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


@dataclass(frozen=True)
class Rule:
    """Drop IPv4 packets from `src` (to TCP port `port` only, when given)."""

    src: str
    port: int | None = None


def drop_program(rules: Sequence[Rule]) -> str:
    """The cls_bpf `bytecode` string dropping packets that match any rule (pure)."""
    ops: list[tuple[int, int | str, int | str, int]] = []  # code, jt, jf, k; jumps to labels
    ops.append((_LD_H_ABS, 0, 0, 12))
    ops.append((_JEQ, 0, "pass", 0x0800))
    for i, rule in enumerate(rules):
        nxt = f"r{i + 1}"
        ops.append((_LD_W_ABS, 0, 0, 26))  # source address
        if rule.port is None:
            ops.append((_JEQ, "drop", nxt, _ip4(rule.src)))
        else:
            ops.append((_JEQ, 0, nxt, _ip4(rule.src)))
            ops.append((_LD_B_ABS, 0, 0, 23))  # protocol
            ops.append((_JEQ, 0, nxt, 6))
            ops.append((_LDX_MSH, 0, 0, 14))  # X = IP header length
            ops.append((_LD_H_IND, 0, 0, 16))  # TCP destination port (14 + X + 2)
            ops.append((_JEQ, "drop", nxt, rule.port))
        ops.append((-1, 0, 0, i + 1))  # label r{i+1}: marks, emits nothing
    labels: dict[str, int] = {}
    code: list[tuple[int, int | str, int | str, int]] = []
    for op in ops:
        if op[0] == -1:
            labels[f"r{op[3]}"] = len(code)
        else:
            code.append(op)
    labels["pass"] = len(code)
    code.append((_RET, 0, 0, _TC_ACT_UNSPEC))
    labels["drop"] = len(code)
    code.append((_RET, 0, 0, _TC_ACT_SHOT))

    def rel(pc: int, target: int | str) -> int:
        return 0 if isinstance(target, int) else labels[target] - pc - 1

    lines = [f"{c} {rel(pc, jt)} {rel(pc, jf)} {k}" for pc, (c, jt, jf, k) in enumerate(code)]
    return ",".join([str(len(lines)), *lines])


@dataclass
class Host:
    name: str
    addr: str
    ns: str
    port: str  # its veth end on the bridge, in the bridge namespace


@dataclass
class NetLab:
    workdir: Path
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    children: Children = field(init=False)
    _blocks: dict[str, set[Rule]] = field(default_factory=dict)
    _shapers: dict[str, Child] = field(default_factory=dict)
    _lock: int | None = None

    def __post_init__(self) -> None:
        self.children = Children(self.workdir / "logs")

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    @property
    def root_link(self) -> str:
        return self.tag

    # ---- set-up and tear-down ------------------------------------------------------
    @staticmethod
    def check_available() -> None:
        if sys.platform != "linux" or os.geteuid() != 0:
            raise LabUnavailable("network-fault tests need root on Linux (network namespaces)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LabUnavailable(f"network-fault tests need `{tool}` (iproute2)")
        probe = f"{PREFIX}{os.getpid()}-probe"
        made = _run("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            raise LabUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
        _run("ip", "netns", "del", probe, check=False)

    def open(self) -> NetLab:
        self.check_available()
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(LOCK_PATH, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # one lab per machine: one observer address
        try:
            sweep()
            _run("ip", "netns", "add", self.bridge_ns)
            self._ns(self.bridge_ns, "ip", "link", "add", _BR, "type", "bridge")
            self._ns(self.bridge_ns, "ip", "link", "set", _BR, "up")
            self._ns(self.bridge_ns, "ip", "link", "set", "lo", "up")
            # The observer: the root namespace's one way in.
            _run("ip", "link", "add", self.root_link, "type", "veth", "peer", "name", "v-obs", "netns", self.bridge_ns)
            self._ns(self.bridge_ns, "ip", "link", "set", "v-obs", "master", _BR, "up")
            _run("ip", "addr", "add", f"{OBSERVER_ADDR}/24", "dev", self.root_link)
            _run("ip", "link", "set", self.root_link, "gso_max_segs", "1", "up")
        except BaseException:
            self.close()
            raise
        return self

    def add_host(self, name: str, addr: str) -> Host:
        ns = f"{self.tag}-{name}"
        port = f"v-{name}"
        _run("ip", "netns", "add", ns)
        host = Host(name, addr, ns, port)
        self.hosts[name] = host
        _run("ip", "link", "add", f"{self.tag}t", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "link", "set", f"{self.tag}t", "netns", self.bridge_ns)
        self._ns(self.bridge_ns, "ip", "link", "set", f"{self.tag}t", "name", port)
        self._ns(self.bridge_ns, "ip", "link", "set", port, "master", _BR, "up")
        self._ns(ns, "ip", "link", "set", "lo", "up")
        self._ns(ns, "ip", "addr", "add", f"{addr}/24", "dev", "eth0")
        # One TCP segment per frame: the shaper forwards frames as they are, at the MTU.
        self._ns(ns, "ip", "link", "set", "eth0", "gso_max_segs", "1", "up")
        return host

    def close(self) -> None:
        """Everything this run made, by name; safe to call in any state, more than once."""
        for child in list(self._shapers.values()):
            child.kill()
        self._shapers.clear()
        self.children.stop_all()
        _remove_run(self.tag)
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    # ---- processes -----------------------------------------------------------------
    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run in the host's namespace (`ip netns exec` execs it: same PID)."""
        return ["ip", "netns", "exec", self.hosts[host].ns, *argv]

    # ---- faults --------------------------------------------------------------------
    def block(self, dst: str, srcs: Sequence[str], port: int | None = None) -> None:
        """`dst` drops what `srcs` (host names, or "observer") send it (to `port` only if given)."""
        rules = self._blocks.setdefault(dst, set())
        rules.update(Rule(self._addr(s), port) for s in srcs)
        self._apply(dst)

    def cut(self, a: str, others: Sequence[str]) -> None:
        """`a` and each of `others` lose each other, both ways."""
        self.block(a, others)
        for o in others:
            self.block(o, [a])

    def heal(self) -> None:
        """Every block lifted."""
        for dst in list(self._blocks):
            self._blocks[dst] = set()
            self._apply(dst)
        self._blocks.clear()

    def shape(self, host: str, delay_ms: int, loss: float, seed: int = 1) -> None:
        """Every frame to and from `host` delayed `delay_ms` and dropped with probability
        `loss`, each direction, by a userspace forwarder in place of its bridge port."""
        h = self.hosts[host]
        side, bridge_side = f"s-{host}", f"t-{host}"
        self._ns(self.bridge_ns, "ip", "link", "add", side, "type", "veth", "peer", "name", bridge_side)
        self._ns(self.bridge_ns, "ip", "link", "set", side, "gso_max_segs", "1", "up")
        self._ns(self.bridge_ns, "ip", "link", "set", bridge_side, "gso_max_segs", "1", "master", _BR, "up")
        argv = [sys.executable, "-m", "meshd.testing.shaper", h.port, side, str(delay_ms), str(loss), str(seed)]
        child = self.children.start(
            f"shaper-{host}", ["ip", "netns", "exec", self.bridge_ns, *argv], env={"PYTHONUNBUFFERED": "1"}
        )
        self._shapers[host] = child
        # Its sockets are bound before the port leaves the bridge (no gap but the switch).
        import time

        deadline = time.monotonic() + 30
        while "forwarding" not in child.log_tail(5):
            if not child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"shaper for {host} did not start:\n{child.log_tail()}")
            time.sleep(0.05)
        self._ns(self.bridge_ns, "ip", "link", "set", h.port, "nomaster")

    def unshape(self, host: str) -> None:
        h = self.hosts[host]
        self._ns(self.bridge_ns, "ip", "link", "set", h.port, "master", _BR)
        child = self._shapers.pop(host, None)
        if child is not None:
            child.stop(timeout_s=5)
        self._ns(self.bridge_ns, "ip", "link", "del", f"s-{host}", check=False)

    # ---- internals -----------------------------------------------------------------
    def _addr(self, name: str) -> str:
        return OBSERVER_ADDR if name == "observer" else self.hosts[name].addr

    def _apply(self, dst: str) -> None:
        ns = self.hosts[dst].ns
        self._ns(ns, "tc", "qdisc", "del", "dev", "eth0", "ingress", check=False)
        rules = sorted(self._blocks.get(dst, set()), key=lambda r: (r.src, r.port or 0))
        if not rules:
            return
        self._ns(ns, "tc", "qdisc", "add", "dev", "eth0", "handle", "ffff:", "ingress")
        program = drop_program(rules)
        self._ns(ns, "tc", "filter", "add", "dev", "eth0", "parent", "ffff:", "protocol", "all", "prio", "1",
                 "bpf", "da", "bytecode", program)  # fmt: skip

    @staticmethod
    def _ns(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        if argv[0] in ("ip", "tc"):
            return _run(argv[0], "-n", ns, *argv[1:], check=check)
        return _run("ip", "netns", "exec", ns, *argv, check=check)

    def __enter__(self) -> NetLab:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_run(tag: str) -> None:
    """The processes, namespaces and root links of one run, by name."""
    listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip() and line.split()[0].startswith(f"{tag}-")]
    for ns in names:
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for ns in names:
        _run("ip", "netns", "del", ns, check=False)
    _run("ip", "link", "del", tag, check=False)


def sweep() -> None:
    """Remove what runs of this lab left behind when their process is gone."""
    listed = _run("ip", "netns", "list", check=False).stdout + _run("ip", "-o", "link", "show", check=False).stdout
    tags = {m.group(1) for m in re.finditer(rf"\b({PREFIX}(\d+))(?:-|@|:)", listed)}
    for tag in tags:
        if not _pid_alive(int(tag[len(PREFIX) :])):
            _remove_run(tag)
