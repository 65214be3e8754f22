"""The layout's rules, held against the code: each room (a package directly under meshd/) says
in its docstring what it may import (`May import: ...`), and the imports must keep to it.

- a room imports only itself, the rooms its docstring names, the generated protos and
  `meshd.__version__`; nothing below the assembly imports the assembly (config, mesh, cli,
  demo); `testing` sits beside the assembly and may import anything;
- the pure rooms (core, decisions) import no I/O or event-loop library and read no wall clock;
- no two modules import each other, directly or round a loop (function-level imports count);
- `sim/` imports only the pure rooms;
- the rooms' allowances themselves run one way (no room allowed to import one that may import it).

Each rule is also run on a small tree of its own making, so a broken checker shows.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSEMBLY = {"config", "mesh", "cli", "demo", "__main__", "__init__"}
ANYTHING = "anything"
PURE = {"core", "decisions"}
# Libraries that do I/O, run an event loop or read the wall clock: not for the pure rooms.
IMPURE = {
    *("asyncio", "aetcd", "aiohttp", "grpc", "os", "socket", "subprocess", "threading", "uvloop"),
    *("time", "datetime"),  # the wall clock: decisions take `now_ms`
    "importlib",  # an import by name would slip past these rules
}
PURE_EXCEPTIONS = {
    ("meshd.core.clock", "time"),  # the one wall clock, which the daemon injects
    ("meshd.core.errors", "grpc"),  # only grpc.StatusCode: each error's status
}
ALWAYS_ALLOWED = {"_proto", "__version__"}
_MAY_IMPORT = re.compile(r"^May import:\s*(.+?)\.?\s*$", re.M)


@dataclass
class Tree:
    """The modules of one package tree and the meshd modules each imports."""

    imports: dict[str, set[str]] = field(default_factory=dict)  # module -> meshd modules/names it imports
    externals: dict[str, set[str]] = field(default_factory=dict)  # module -> top-level outside packages
    docs: dict[str, str] = field(default_factory=dict)  # package -> its docstring


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def scan(root: Path, package: str = "meshd") -> Tree:
    tree = Tree()
    for path in sorted(root.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        mod = module_name(path, root)
        syntax = ast.parse(path.read_text(encoding="utf-8"))
        if path.name == "__init__.py":
            tree.docs[mod] = ast.get_docstring(syntax) or ""
        found: set[str] = set()
        outside: set[str] = set()
        package_parts = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(syntax):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # `from ..x import y`: resolved against this module's package
                    anchor = package_parts[: len(package_parts) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                if not base:
                    continue
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
                outside.add("importlib")  # the same hole as importlib.import_module
                continue
            else:
                continue
            for name in names:
                if name == package or name.startswith(package + "."):
                    found.add(name)
                else:
                    outside.add(name.split(".")[0])
        tree.imports[mod] = found
        tree.externals[mod] = outside
    return tree


def room_of(name: str) -> str:
    """The room a meshd module (or a name imported from one) belongs to."""
    parts = name.split(".")
    if len(parts) == 1:
        return "__version__"  # `import meshd` / `from meshd import __version__`
    return "assembly" if parts[1] in ASSEMBLY else parts[1]


def home_of(module: str) -> str:
    """The room a module of the tree lives in (the package's own __init__ is the assembly's)."""
    return "assembly" if "." not in module else room_of(module)


def allowances(tree: Tree, package: str = "meshd") -> dict[str, set[str]]:
    """room -> rooms it may import, read from each room's docstring."""
    allowed: dict[str, set[str]] = {}
    for pkg, doc in tree.docs.items():
        if pkg.count(".") != 1:
            continue
        match = _MAY_IMPORT.search(doc)
        room = pkg.split(".")[1]
        if match is None:
            raise AssertionError(f"{pkg}/__init__.py: the docstring has no 'May import:' line")
        text = match.group(1).strip()
        if text.startswith("nothing"):
            allowed[room] = set()
        elif text.startswith(ANYTHING):
            allowed[room] = {ANYTHING}
        else:
            allowed[room] = {r.strip() for r in text.split(",")}
    return allowed


def room_violations(tree: Tree, allowed: dict[str, set[str]]) -> Iterator[str]:
    known = set(allowed) | {"assembly"}
    for mod, names in sorted(tree.imports.items()):
        mine = home_of(mod)
        if mine == "assembly" or ANYTHING in allowed.get(mine, set()):
            continue
        if mine not in allowed:
            yield f"{mod}: room {mine!r} has no package docstring saying what it may import"
            continue
        for name in sorted(names):
            other = room_of(name)
            if other == "__version__" and name.count(".") == 1 and name.split(".")[1] not in ASSEMBLY:
                other = name.split(".")[1]  # `from meshd import X` names the room X
            if other in (mine, *ALWAYS_ALLOWED) or other in allowed[mine]:
                continue
            what = "the assembly" if other == "assembly" else f"room {other!r}"
            if other not in known:
                what = f"unknown room {other!r}"
            yield f"{mod} ({mine}) imports {name}: {what} is not in its 'May import' list"


def purity_violations(tree: Tree) -> Iterator[str]:
    for mod, outside in sorted(tree.externals.items()):
        if home_of(mod) not in PURE:
            continue
        for lib in sorted(outside & IMPURE):
            if (mod, lib) not in PURE_EXCEPTIONS:
                yield f"{mod} is in a pure room but imports {lib}"


def cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    graph = {m: {n for n in names if n in imports and n != m} for m, names in imports.items()}
    # `from meshd.x import y` names both meshd.x and meshd.x.y: keep only real modules.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def allowance_loops(allowed: dict[str, set[str]]) -> list[list[str]]:
    graph = {r: {o for o in rooms if o in allowed} for r, rooms in allowed.items() if ANYTHING not in rooms}
    return cycles({r: set(v) & set(graph) for r, v in graph.items()})


# ---- the real code -----------------------------------------------------------------------
MESHD = scan(REPO / "meshd")


def test_every_room_says_what_it_owns_and_may_import() -> None:
    rooms = {p.name for p in (REPO / "meshd").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms.discard("_proto")
    allowed = allowances(MESHD)
    assert rooms == set(allowed), "every room needs a 'May import:' line in its __init__ docstring"
    assert not [r for r in rooms if len(MESHD.docs[f"meshd.{r}"].splitlines()) < 3], "each room says what it owns"


def test_imports_keep_to_each_rooms_allowance() -> None:
    assert list(room_violations(MESHD, allowances(MESHD))) == []


def test_pure_rooms_do_no_io() -> None:
    assert list(purity_violations(MESHD)) == []


def test_no_module_imports_round_a_loop() -> None:
    assert cycles(MESHD.imports) == []


def test_allowances_run_one_way() -> None:
    assert allowance_loops(allowances(MESHD)) == []


def test_allowances_name_rooms_and_never_the_assembly() -> None:
    allowed = allowances(MESHD)
    named = {room for rooms in allowed.values() for room in rooms} - {ANYTHING}
    assert named <= set(allowed), f"not rooms: {sorted(named - set(allowed))}"


def test_sim_imports_only_the_pure_rooms() -> None:
    sim = scan(REPO / "sim", package="sim")
    uses = {name for outside in sim.externals.values() for name in outside}
    assert "meshd" in uses  # the simulator does run meshd's decisions
    found: set[str] = set()
    for path in (REPO / "sim").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshd"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("meshd"))
    assert found, "sim/ imports meshd's decisions"
    assert sorted(m for m in found if room_of(m) not in PURE) == []


# ---- the checker on trees of its own making --------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "meshd" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "meshd"


def _rooms(core: str = "nothing", upper: str = "core") -> dict[str, str]:
    return {
        "__init__.py": '"""top"""\n',
        "core/__init__.py": f'"""core\n\nOwns: x.\n\nMay import: {core}.\n"""\n',
        "core/a.py": "X = 1\n",
        "upper/__init__.py": f'"""upper\n\nOwns: y.\n\nMay import: {upper}.\n"""\n',
        "upper/b.py": "from meshd.core.a import X\n",
        "mesh.py": "from meshd.upper.b import X\n",
    }


def test_the_checker_passes_a_tree_that_keeps_the_rules(tmp_path: Path) -> None:
    tree = scan(_write(tmp_path, _rooms()))
    allowed = allowances(tree)
    assert allowed == {"core": set(), "upper": {"core"}}
    assert list(room_violations(tree, allowed)) == []
    assert cycles(tree.imports) == [] and allowance_loops(allowed) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"core/a.py": "from meshd.upper.b import X\n"}, "meshd.core.a (core) imports meshd.upper.b"),
        ({"core/a.py": "def f():\n    from meshd import mesh\n"}, "imports meshd.mesh: the assembly"),
        ({"core/a.py": "import meshd.other.c\n"}, "unknown room 'other'"),
    ],
)
def test_the_checker_finds_an_import_outside_the_allowance(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    tree = scan(_write(tmp_path, {**_rooms(), **files}))
    found = list(room_violations(tree, allowances(tree)))
    assert any(expected in v for v in found), found


def test_the_checker_resolves_relative_imports(tmp_path: Path) -> None:
    files = {
        "core/a.py": "from ..upper import b\nfrom . import a2\n",
        "core/a2.py": "from .a import X\n",
    }
    tree = scan(_write(tmp_path, {**_rooms(), **files}))
    found = list(room_violations(tree, allowances(tree)))
    assert any("meshd.core.a (core) imports meshd.upper.b" in v for v in found), found
    assert cycles(tree.imports) == [["meshd.core.a", "meshd.core.a2", "meshd.upper.b"]]


def test_the_checker_finds_imports_by_name_and_the_wall_clock_in_a_pure_room(tmp_path: Path) -> None:
    files = {
        "core/a.py": "import importlib\nm = importlib.import_module('meshd.upper.b')\n",
        "core/c.py": "import datetime\nnow = datetime.datetime.now()\n",
        "core/d.py": "m = __import__('meshd.upper.b')\n",
    }
    tree = scan(_write(tmp_path, {**_rooms(), **files}))
    assert sorted(purity_violations(tree)) == [
        "meshd.core.a is in a pure room but imports importlib",
        "meshd.core.c is in a pure room but imports datetime",
        "meshd.core.d is in a pure room but imports importlib",
    ]


def test_the_checker_finds_io_in_a_pure_room_and_a_loop(tmp_path: Path) -> None:
    files = {
        "core/a.py": "import asyncio\nfrom meshd.core.c import Y\nX = 1\n",
        "core/c.py": "def f():\n    from meshd.core.a import X\nY = 2\n",
    }
    tree = scan(_write(tmp_path, {**_rooms(), **files}))
    assert list(purity_violations(tree)) == ["meshd.core.a is in a pure room but imports asyncio"]
    assert cycles(tree.imports) == [["meshd.core.a", "meshd.core.c"]]


def test_the_checker_finds_allowances_that_loop_and_a_room_without_its_line(tmp_path: Path) -> None:
    tree = scan(_write(tmp_path, _rooms(core="upper")))
    assert allowance_loops(allowances(tree)) == [["core", "upper"]]
    (tmp_path / "meshd" / "core" / "__init__.py").write_text('"""core, no allowance"""\n', encoding="utf-8")
    with pytest.raises(AssertionError, match="no 'May import:' line"):
        allowances(scan(tmp_path / "meshd"))
