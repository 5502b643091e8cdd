"""The import rules of docs/architecture.md, held to the source: dit_accel -> planner only, the planner free
of torch and the GPU stack, nothing imports the trainer's entry module, no import circle (imports inside
functions count), and no dit_accel module grown past the size one reads in a sitting."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"dit_accel", "torch", "accelerate", "diffusers", "datasets", "numpy", "safetensors"}
MAX_MODULE_LINES = 700


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere (a name imported from a module counts as that
    module, or as the submodule of that name where there is one). Third-party roots are kept as given."""
    files = {}
    for package in ("planner", "dit_accel"):
        for path in (ROOT / package).rglob("*.py"):
            files[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.level == 0, f"{name}: relative import"
                targets |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                }
        graph[name] = {t for t in targets if t != name}
    return graph


def test_the_planner_imports_neither_dit_accel_nor_the_gpu_stack():
    for name, targets in import_graph().items():
        if name.startswith("planner"):
            assert not {t.split(".")[0] for t in targets} & HEAVY, (name, targets)


def test_no_module_imports_the_trainers_entry_module():
    importers = [name for name, targets in import_graph().items() if "dit_accel.train" in targets]
    assert importers == [], importers


def test_there_is_no_import_circle():
    graph = import_graph()
    project = {name: {t for t in targets if t in graph} for name, targets in graph.items()}
    finished: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "import circle: " + " -> ".join(path[path.index(name) :] + [name])
        if name in finished:
            return
        for target in sorted(project[name]):
            visit(target, path + [name])
        finished.add(name)

    for name in sorted(project):
        visit(name, [])
    assert len(finished) == len(project) > 40


def test_the_training_loop_and_every_module_stay_readable():
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in (ROOT / "dit_accel").rglob("*.py")}
    assert sizes[Path("dit_accel/train.py")] <= 300
    largest = max(sizes.items(), key=lambda kv: kv[1])
    assert largest[1] <= MAX_MODULE_LINES, largest
