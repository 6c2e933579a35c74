"""The node's rooms hold: no room imports one above it in the declared order,
the root API (``client``, ``protocol``, ``control``) imports no daemon code,
each room's ``__init__`` lists its modules (docs/README.md maps the rooms), and
the fetch core is asked through its methods, not reached into by attribute hops.

Read from the source (every import, lazy and type-checking ones too), so the
test needs no daemon and runs in the fast tier.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

NODE = Path(__file__).resolve().parents[1] / "layerfs" / "node"
PACKAGE = ("layerfs", "node")

# Low to high: a room imports only rooms before it. Rooms on one line are
# peers and import none of each other. "api" is the root's protocol and control.
ORDER = [
    {"api"},
    {"replica"},
    {"reads"},
    {"containers"},
    {"sandboxes"},
    {"vms", "containerd"},
    {"fuse"},
    {"daemon"},
]
# Crossings against the order, each with why it is still there.
KNOWN: dict[tuple[str, str], str] = {}
# The root API's client loads these helpers lazily (a bundle, limits, room);
# nothing of the daemon, FUSE, the read path or the replica.
API_MAY_IMPORT = {"containers", "sandboxes"}
API_MODULES = {"client", "protocol", "control", "__init__"}


def rank(room: str) -> int:
    return next(i for i, rooms in enumerate(ORDER) if room in rooms)


def rooms() -> list[str]:
    return sorted(p.name for p in NODE.iterdir() if (p / "__init__.py").exists())


def module_of(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(NODE.parents[1]).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(path: Path) -> set[tuple[str, ...]]:
    """Every ``layerfs.node`` module (or name in one) ``path`` imports."""
    module = module_of(path)
    package = module if path.name == "__init__.py" else module[:-1]
    found: set[tuple[str, ...]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {tuple(a.name.split(".")) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = tuple((node.module or "").split(".")) if node.module else ()
            if node.level:
                base = package[:len(package) - (node.level - 1)] + base
            found |= {base + (a.name,) for a in node.names}
    return {m for m in found if m[:2] == PACKAGE and len(m) > 2}


def where(module: tuple[str, ...]) -> tuple[str, str]:
    """(room, module in it) of a ``layerfs.node`` name; the root's are "api"."""
    rest = module[2:]
    if not rest:
        return "api", "__init__"
    if (NODE / rest[0] / "__init__.py").exists():
        return rest[0], rest[1] if len(rest) > 1 else "__init__"
    return "api", rest[0]


def node_modules() -> list[Path]:
    return sorted(p for p in NODE.rglob("*.py")
                  if "__pycache__" not in p.parts and "_pb2" not in p.name)


def test_every_room_has_a_place_in_the_order():
    assert set(rooms()) == set().union(*ORDER) - {"api"}


def test_the_root_holds_only_the_api():
    assert {p.stem for p in NODE.glob("*.py")} == API_MODULES


@pytest.mark.parametrize("path", node_modules(), ids=lambda p: str(p.relative_to(NODE)))
def test_no_room_imports_one_above_it(path):
    room, name = where(module_of(path))
    wrong = []
    for target in imports(path):
        to_room, to_name = where(target)
        if to_room == room or (room, to_room) == ("api", "api"):
            continue
        if room == "api":
            if to_room not in API_MAY_IMPORT:
                wrong.append(f"{'.'.join(target)} (the root API imports no daemon code)")
            continue
        if rank(to_room) >= rank(room) and (f"{room}.{name}", f"{to_room}.{to_name}") not in KNOWN:
            wrong.append(".".join(target))
    assert not wrong, f"{path.relative_to(NODE)} ({room}) imports against the order: {wrong}"


def test_the_known_crossings_are_still_there():
    """An entry of KNOWN that no longer happens is taken out."""
    seen = set()
    for path in node_modules():
        room, name = where(module_of(path))
        for target in imports(path):
            to_room, to_name = where(target)
            seen.add((f"{room}.{name}", f"{to_room}.{to_name}"))
    assert set(KNOWN) <= seen


@pytest.mark.parametrize("room", rooms())
def test_a_room_says_its_job_and_lists_its_modules(room):
    doc = ast.get_docstring(ast.parse((NODE / room / "__init__.py").read_text())) or ""
    members = {p.stem for p in (NODE / room).glob("*.py") if p.stem != "__init__"}
    members |= {p.name for p in (NODE / room).iterdir() if (p / "__init__.py").exists()}
    assert doc and all(f"``{m}``" in doc for m in members), (room, sorted(members))
    body = ast.parse((NODE / room / "__init__.py").read_text()).body
    assert len(body) == 1, f"{room}/__init__.py re-exports: it holds its docstring only"


# The fetch core: the only modules that read its state (its chunk states, the
# timeout, its slots, its task group's nursery) by attribute.
FETCH_CORE = {Path("reads/fetcher.py"), Path("reads/chunkstates.py")}
# A fetcher's attributes other modules may read that are not its methods, with why.
FETCHER_FIELDS = {
    "tasks": "a Prefetcher made without the daemon's task group (a test, a blob file's "
             "own policy) shares the core's; read, never reached through",
}
# Hops the sandboxes and containerd rooms do not take into the read path's parts:
# they are given the policy, and a mounted layer answers for its blob.
HOPS_BARRED = {("blob", "table"), ("blobs", "prefetcher"), ("layers", "fetcher"),
               ("layers", "blobs")}


def fetcher_methods() -> set[str]:
    """``ChunkFetcher``'s public methods: its own, and those it answers with
    its chunk states' (``self.absent = self.states.absent``)."""
    tree = ast.parse((NODE / "reads" / "fetcher.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ChunkFetcher")
    methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    methods |= {a.targets[0].attr for a in init.body if isinstance(a, ast.Assign)
                and isinstance(a.targets[0], ast.Attribute)
                and ast.unparse(a.value).startswith("self.states.")}
    assert {"absent", "claim", "read_held", "slots"} <= methods
    return {m for m in methods if not m.startswith("_")}


def names_fetcher(node: ast.expr) -> bool:
    return ((isinstance(node, ast.Name) and node.id == "fetcher")
            or (isinstance(node, ast.Attribute) and node.attr == "fetcher"))


@pytest.mark.parametrize("path", [p for p in node_modules()
                                  if p.relative_to(NODE) not in FETCH_CORE],
                         ids=lambda p: str(p.relative_to(NODE)))
def test_the_fetch_core_is_asked_through_its_methods(path):
    """Outside the fetch core, a ``fetcher`` is used through its methods
    (``deadline``, ``absent``, ``claim``...), never by hops into its parts
    (``fetcher.states``, ``.timeout``, ``.parallel``, ``.tasks.nursery``)."""
    methods = fetcher_methods()
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    wrong = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and names_fetcher(node.value)):
            continue
        if node.attr in methods:
            continue
        if node.attr in FETCHER_FIELDS and not isinstance(parents.get(node), ast.Attribute):
            continue
        wrong.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not wrong, f"{path.relative_to(NODE)} reaches into the fetch core: {wrong}"


@pytest.mark.parametrize("path", [p for p in node_modules()
                                  if p.relative_to(NODE).parts[0] in ("sandboxes", "containerd")],
                         ids=lambda p: str(p.relative_to(NODE)))
def test_sandboxes_and_containerd_take_no_hops_into_the_read_path(path):
    """(A mounted layer reads its own blob's table: ``self.blob.table``.)"""
    wrong = [f"line {node.lineno}: {ast.unparse(node)}"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
             and (node.value.attr, node.attr) in HOPS_BARRED
             and ast.unparse(node) != "self.blob.table"]
    assert not wrong, f"{path.relative_to(NODE)}: {wrong}"


def test_the_old_entry_point_is_the_cli():
    """``layerfs/tools/main.py`` (for ../shared/device/mkbundle.sh, outside the
    repository) runs the CLI's own ``main`` (the name is built: rooms-map.py
    would rewrite it to the new one)."""
    import importlib

    from layerfs.cli.main import main

    old = importlib.import_module(".".join(("layerfs", "tools", "main")))
    assert old.main is main


def test_no_test_module_imports_another():
    """Shared helpers and fixtures live in tests/support/ (or conftest.py);
    a test module imports none of the others."""
    tests = Path(__file__).resolve().parent
    found = set()
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
                found.add((path.stem, node.module))
            elif isinstance(node, ast.Import):
                found |= {(path.stem, a.name) for a in node.names if a.name.startswith("test_")}
    assert found == set()
