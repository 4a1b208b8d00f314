"""The house keeps its floors: every import in specdecode/ (at the top of a file, inside a function or under
TYPE_CHECKING alike) goes to a room on the same floor or below, and no files import each other in a loop."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specdecode"

# room (a top-level module or package of specdecode/) -> its floor; docs/architecture.md draws the same picture
FLOORS = {
    "kernels": 0, "text": 0, "config": 0, "settings": 0, "errors": 0, "jsonl": 0, "atomic_files": 0, "devices": 0,
    "models": 1, "sampling": 1,
    "planner": 2, "weights": 2, "rules": 2, "verify": 2,
    "drafters": 3,
    "engine": 4, "methods": 4,
    "api": 5, "cli_args": 5,
    "server": 6, "bench": 6, "advise": 6, "training": 6,
    "cli": 7, "__main__": 7, "__init__": 7,
}


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The specdecode modules a file imports (a `from specdecode.x import y` counts as x.y where y is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("specdecode.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specdecode"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (PACKAGE.parent / Path(*sub.split("."))).is_dir()
                found.add(sub if is_module else node.module)
    return found - {"specdecode"}


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    return {module_of(p): imports_of(p) for p in PACKAGE.rglob("*.py")}


def test_every_room_has_a_floor():
    rooms = {room(m) for m in graph()}
    assert rooms <= FLOORS.keys(), f"rooms without a floor (add them to FLOORS and docs/architecture.md): " \
                                   f"{sorted(rooms - FLOORS.keys())}"


def test_no_import_runs_back_up():
    up = [(m, target) for m, targets in graph().items() for target in targets
          if FLOORS[room(target)] > FLOORS[room(m)]]
    assert not up, f"imports from a lower floor to a higher one: {up}"


def test_no_import_circles_between_files():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if target not in edges:
                continue
            if state.get(target) == 1:
                return path + [module, target]
            if state.get(target) is None and (loop := visit(target, path + [module])):
                return loop
        state[module] = 2
        return None

    for module in sorted(edges):
        if state.get(module) is None:
            loop = visit(module, [])
            assert loop is None, f"an import circle: {' -> '.join(loop[loop.index(loop[-1]):])}"


def test_no_room_circles():
    rooms: dict[str, set[str]] = {}
    for module, targets in graph().items():
        rooms.setdefault(room(module), set()).update(room(t) for t in targets if room(t) != room(module))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in rooms.get(start, ()):
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    loops = sorted((a, b) for a, targets in rooms.items() for b in targets if reaches(b, a, set()))
    assert not loops, f"rooms that import each other through others: {loops}"
