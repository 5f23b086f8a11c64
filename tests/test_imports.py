"""The shape of dwarfstar's import graph, read from the source with `ast` (nothing is imported):
no circles, every arrow between rooms pointing down the room order (`ROOMS`), the command line on
top, no arrow from the lower rooms up into the backends (only to the `Backend` protocol, which imports
none), no arrow from outside the backends into a backend's internals
(`test_backends_are_entered_by_their_front_doors`) nor past the `Backend` protocol into a backend
object's attributes (`test_backends_are_driven_through_their_protocol`), and no backend name compared as
a string outside dwarfstar/backends/.

A room is a top-level package or module of dwarfstar (`dwarfstar.session`, `dwarfstar.sampling`);
the `Backend` protocol is a room of its own, below the backends and the session that drives them.
`python tests/test_imports.py` prints the graph's figures: modules, arrows, rooms, arrows between
rooms, upward arrows and circles.

Every import counts as an arrow: at module level, inside a function (deferred so that `--help` stays
fast, but still a dependency) and under `if TYPE_CHECKING:` (a type named is a dependency too).
`import a.b.c` and `from a.b import c` are arrows to the module a.b.c (to the package a.b when c is
not a module); the packages' `__init__` on the way are not counted.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dwarfstar"

# the contract the lower rooms are written against; it imports no backend (checked below)
PROTOCOL = "dwarfstar.backends.protocol"
# every room, lowest first: a module imports only from its own room and the rooms before it
ROOMS = (
    "dwarfstar",  # the package itself: its version
    "errors",
    "gguf",
    "sampling",
    "tokenizer",
    "engram",  # V4.1's Engram tables: row ids from token ids, rows from the file
    "model",
    "prompt",
    "kvcache",  # the disk KV cache, apart from the live session
    PROTOCOL,
    "session",
    "experts",
    "bench",
    "backends",
    "quant",
    "speculative",
    "steering",
    "distributed",
    "train",
    "convert",
    "engine",
    "console",
    "serving",
    "evals",
    "agent",
    "commands",
    "cli",
    "__main__",
)
LOWER_ROOMS = ROOMS[: ROOMS.index("backends")]  # below the backends
BACKEND_NAMES = {"reference", "triton", "mlx"}
ORACLE = "reference"  # the numerical oracle: its plain-torch model and ops define what the others compute
HEAVY = (
    "torch",
    "triton",
    "mlx",
    "starlette",
    "uvicorn",
    "huggingface_hub",
    "httpx2",
    "prompt_toolkit",
    "numpy",
    "PIL",
)


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The dwarfstar modules `name` imports anywhere in its file."""
    anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    found = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target.startswith("dwarfstar") and target != name:
            found.add(target)
    return found


def module_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return module_graph()


def room(name: str) -> str:
    """The room of a dwarfstar module: its top-level package or module, or the protocol's own."""
    if name == PROTOCOL or name.startswith(PROTOCOL + "."):
        return PROTOCOL
    return name.split(".")[1] if "." in name else name


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {room(name): set() for name in graph}
    for name, targets in graph.items():
        rooms[room(name)].update(room(t) for t in targets if room(t) != room(name))
    return rooms


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """The arrows from a module to one in a room after its own in `ROOMS` (or in no room of it)."""
    order = {name: i for i, name in enumerate(ROOMS)}
    return {
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if order.get(room(target), len(ROOMS)) > order.get(room(name), -1)
    }


def figures(graph: dict[str, set[str]]) -> dict[str, int]:
    rooms = room_graph(graph)
    return {
        "modules": len(graph),
        "arrows": sum(len(targets) for targets in graph.values()),
        "rooms": len(rooms),
        "arrows between rooms": sum(len(targets) for targets in rooms.values()),
        "upward arrows": len(upward(graph)),
        "circles of modules": len(circles(graph)),
        "circles of rooms": len(circles(rooms)),
    }


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, arrows = work[-1]
            nxt = next(arrows, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles(graph):
    assert circles(graph) == []


def test_every_room_is_in_the_order(graph):
    assert sorted(set(room_graph(graph)) - set(ROOMS)) == []
    assert sorted(set(ROOMS) - set(room_graph(graph))) == []


def test_every_arrow_points_down_the_room_order(graph):
    assert upward(graph) == set()
    assert circles(room_graph(graph)) == []


def test_the_room_order_finds_an_upward_arrow():
    graph = {"dwarfstar.model.config": {"dwarfstar.session.session"}, "dwarfstar.session.session": set()}
    assert upward(graph) == {("dwarfstar.model.config", "dwarfstar.session.session")}
    assert room("dwarfstar.backends.protocol") == PROTOCOL
    assert room("dwarfstar.backends.triton.backend") == "backends"
    assert room("dwarfstar.sampling") == "sampling"


def test_the_command_line_is_on_top(graph):
    """Only the command line imports the command modules: each command registers on an app defined in
    dwarfstar/commands/apps.py, and cli.py imports the command modules, never the other way."""

    def on_top(name: str) -> bool:
        return name in ("dwarfstar.cli", "dwarfstar.__main__") or name.startswith("dwarfstar.commands")

    up = {(name, target) for name, targets in graph.items() for target in targets if on_top(target) > on_top(name)}
    assert up == set()
    assert {name for name, targets in graph.items() if "dwarfstar.cli" in targets} == {"dwarfstar.__main__"}


def test_no_arrow_from_the_lower_rooms_into_the_backends(graph):
    up = {
        (name, target)
        for name, targets in graph.items()
        if room(name) in LOWER_ROOMS
        for target in targets
        if target.startswith("dwarfstar.backends") and target != PROTOCOL
    }
    assert up == set()
    assert {target for target in graph[PROTOCOL] if target.startswith("dwarfstar.backends")} == set()


def reaches_inside(name: str, target: str) -> bool:
    """Whether module `name` (outside dwarfstar/backends/) importing `target` reaches into a backend.

    The rule: outside the backends, a backend is entered by its front door, the package itself
    (`dwarfstar.backends.triton`: whether it runs here, how it loads), or through `backends.registry`
    and `backends.protocol`; a module inside a backend's package (`dwarfstar.backends.<name>.<...>`) is
    its business. Two kinds of importer may go further, each for a reason of its kind, not by name:
    the command line (`dwarfstar.commands.*`, on top of everything: a backend's own command, such as
    `bench gpu`, drives that backend's tools), and any module importing the oracle (`ORACLE`), whose
    plain-torch model and ops are the definition training and quantization measure against.
    """
    parts = target.split(".")
    inside = parts[:2] == ["dwarfstar", "backends"] and len(parts) > 3 and parts[2] in BACKEND_NAMES
    return inside and parts[2] != ORACLE and not name.startswith("dwarfstar.commands.")


def test_backends_are_entered_by_their_front_doors(graph):
    inside = {
        (name, target)
        for name, targets in graph.items()
        if not name.startswith("dwarfstar.backends.")
        for target in targets
        if reaches_inside(name, target)
    }
    assert inside == set()


def test_the_front_door_rule():
    assert reaches_inside("dwarfstar.distributed.stage", "dwarfstar.backends.mlx.storage")
    assert reaches_inside("dwarfstar.steering.apply", "dwarfstar.backends.triton.kernels.sampling")
    assert not reaches_inside("dwarfstar.steering.apply", "dwarfstar.backends.triton")  # the front door
    assert not reaches_inside("dwarfstar.engine", "dwarfstar.backends.registry")
    assert not reaches_inside("dwarfstar.train.mtp", "dwarfstar.backends.reference.model")  # the oracle
    assert not reaches_inside("dwarfstar.commands.bench_gpu", "dwarfstar.backends.triton.gpu_bench")


def protocol_names() -> set[str]:
    """What the `Backend` protocol declares: its attributes and methods."""
    tree = ast.parse((PACKAGE / "backends" / "protocol.py").read_text(encoding="utf-8"))
    protocol = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Backend")
    names = {node.target.id for node in protocol.body if isinstance(node, ast.AnnAssign)}
    return names | {node.name for node in protocol.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


class BackendAccess(ast.NodeVisitor):
    """The attributes read or written on a backend object, as (line, name), outside the protocol's names.

    A backend object, by what the code says rather than by inference: anything's `.backend`
    (`engine.backend`, `self.backend`), a name `backend`, a name annotated `Backend`, and a name
    assigned from one of those (`tokenizer, backend = engine.tokenizer, engine.backend`). Not a name
    annotated with another type (a registry entry called `backend`), nor one narrowed to a type T: in
    the body of `if isinstance(name, T):`, or after `if not isinstance(name, T): raise ...` (T is
    `model.forward.Transformer`: every backend is one, and its interface is the backend-neutral model's,
    not a backend's internals).
    """

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed
        self.scopes: list[set[str]] = [{"backend"}]
        self.narrowed: list[str] = []
        self.found: list[tuple[int, str]] = []

    @staticmethod
    def _names(annotation: ast.expr) -> set[str]:
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        return {node.id for node in ast.walk(annotation) if isinstance(node, ast.Name)}

    def _is_backend(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "backend"
        return isinstance(node, ast.Name) and node.id in self.scopes[-1]

    def _bind(self, target: ast.expr, value: ast.expr | None, annotation: ast.expr | None = None) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind(t, v)
        elif isinstance(target, ast.Name):
            typed = annotation is not None and "Backend" in self._names(annotation)
            if typed or (value is not None and self._is_backend(value)):
                self.scopes[-1].add(target.id)
            elif annotation is not None:
                self.scopes[-1].discard(target.id)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        scope = {"backend"}
        args = node.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if arg.annotation is not None:
                (scope.add if "Backend" in self._names(arg.annotation) else scope.discard)(arg.arg)
        self.scopes.append(scope)
        narrowed = len(self.narrowed)
        self.generic_visit(node)
        del self.narrowed[narrowed:]  # a guard narrows to the end of its function
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            self._bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        self._bind(node.target, node.value, node.annotation)

    def _narrowed_subject(self, test: ast.expr) -> str | None:
        """The backend expression `isinstance(expr, T)` tests, as `ast.dump` writes it."""
        if isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance":
            if test.args and self._is_backend(test.args[0]):
                return ast.dump(test.args[0])
        return None

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        self.visit(test)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            subject = self._narrowed_subject(test.operand)
            for statement in [*node.body, *node.orelse]:
                self.visit(statement)
            if subject is not None and isinstance(node.body[-1], ast.Raise | ast.Return):
                self.narrowed.append(subject)  # a guard: what follows sees a T
            return
        subject = self._narrowed_subject(test)
        if subject is not None:
            self.narrowed.append(subject)
            for statement in node.body:
                self.visit(statement)
            self.narrowed.pop()
        else:
            for statement in node.body:
                self.visit(statement)
        for statement in node.orelse:
            self.visit(statement)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._is_backend(node.value) and ast.dump(node.value) not in self.narrowed and node.attr not in self.allowed:
            self.found.append((node.lineno, node.attr))
        self.generic_visit(node)


def backend_internals(source: str, allowed: set[str]) -> list[tuple[int, str]]:
    """Where `source` reaches past the `Backend` protocol (`allowed`) into a backend object."""
    visitor = BackendAccess(allowed)
    visitor.visit(ast.parse(source))
    return visitor.found


def test_backends_are_driven_through_their_protocol(graph):
    """Outside dwarfstar/backends/, a backend object is used only by the names the `Backend` protocol
    declares; what else a backend offers is asked of its registry entry (`backends.registry`). Excepted
    as in the front-door rule: the command line, and modules that import the oracle."""
    allowed = protocol_names()
    found = {}
    for name, path in modules().items():
        oracle = any(t.startswith(f"dwarfstar.backends.{ORACLE}.") for t in graph[name])
        if name.startswith(("dwarfstar.backends.", "dwarfstar.commands.")) or oracle:
            continue
        reached = backend_internals(path.read_text(encoding="utf-8"), allowed)
        if reached:
            found[name] = reached
    assert found == {}


def test_the_protocol_access_finder():
    source = """
def run(engine, entry: BackendEntry, model: Backend, backend: BackendMemory):
    engine.backend.forward([1], engine.backend.new_state())
    engine.backend.ops.route_observer = None
    backend.usable_memory()
    model.weights
    tokenizer, inner = engine.tokenizer, engine.backend
    inner.cache.clear()
    if isinstance(inner, Transformer):
        inner.block = None
    inner.block = None


def other(backend):
    backend.args, backend.kernels
    if not isinstance(backend, Transformer):
        raise TypeError(backend.kind)
    return backend.layer_range
"""
    found = backend_internals(source, protocol_names())
    assert found == [(4, "ops"), (6, "weights"), (8, "cache"), (11, "block"), (15, "kernels"), (17, "kind")]


def name_comparisons(path: Path) -> int:
    """Comparisons (==, !=, in, not in) with a backend's name as a string literal on either side."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            count += any(isinstance(s, ast.Constant) and s.value in BACKEND_NAMES for s in sides)
    return count


def test_backend_names_are_compared_only_in_the_backends():
    found = Counter()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith("dwarfstar/backends/"):
            found[relative] = name_comparisons(path)
    assert +found == Counter()


def test_the_name_comparison_finder(tmp_path):
    source = tmp_path / "x.py"
    source.write_text('if backend == "triton" or "mlx" != name or kind in ("a",):\n    pass\nx = "reference"\n')
    assert name_comparisons(source) == 2


def test_the_command_line_imports_nothing_heavy():
    """Every command module is imported (as `dwarfstar --help` does) without torch, the server, the
    hub client or the terminal UI, so the help answers at once."""
    script = (
        "import sys; from dwarfstar.cli import _register_commands; _register_commands(); "
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


if __name__ == "__main__":
    for label, value in figures(module_graph()).items():
        print(f"{label}: {value}")
