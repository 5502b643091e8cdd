"""The import rules of docs/architecture.md, held to the source: dit_accel -> planner only, the planner free
of torch and the GPU stack, nothing imports the training loop, the packages of dit_accel in one order
(no two import each other, no circle among them or among modules; imports inside functions count), few
modules left at the top of dit_accel, and no module grown past the size one reads in a sitting."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"dit_accel", "torch", "accelerate", "diffusers", "datasets", "numpy", "safetensors"}
MAX_MODULE_LINES = 700
MAX_TOP_LEVEL_MODULES = 8  # beside the packages: the CLI dispatcher, errors and small shared helpers

# dit_accel's packages from the bottom up, as docs/architecture.md draws them: each may import only those
# before it (and the foundations, the top-level modules but `cli`). A new package must be placed here.
LAYERS = (
    "models",
    "repa",
    "diffusion",
    "evaluate",
    "distributed",
    "run",
    "data",
    "sample",
    "train",
    "doctor",
    "memtrace",
    "convert",
)


def project_files() -> dict[str, Path]:
    files = {}
    for package in ("planner", "dit_accel"):
        for path in (ROOT / package).rglob("*.py"):
            files[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return files


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere (a name imported from a module counts as that
    module, or as the submodule of that name where there is one). Third-party roots are kept as given."""
    files = project_files()
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


def part_of(module: str) -> str:
    """The package of dit_accel a module belongs to, or the top-level module itself ('errors', 'cli')."""
    return module.split(".")[1] if module.count(".") >= 1 else module


def package_graph() -> dict[str, set[str]]:
    """Part -> the other parts of dit_accel it imports (a top-level module is a part of its own)."""
    parts: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        if name.startswith("dit_accel."):
            parts.setdefault(part_of(name), set()).update(
                part_of(t) for t in targets if t.startswith("dit_accel.") and part_of(t) != part_of(name)
            )
    return parts


def test_the_planner_imports_neither_dit_accel_nor_the_gpu_stack():
    for name, targets in import_graph().items():
        if name.startswith("planner"):
            assert not {t.split(".")[0] for t in targets} & HEAVY, (name, targets)


def test_nothing_imports_the_training_loop():
    """`python -m dit_accel.train` runs `train.loop`; the commands above the trainer use its parts."""
    importers = [
        name
        for name, targets in import_graph().items()
        if {"dit_accel.train.loop", "dit_accel.train.__main__"} & targets
        and name != "dit_accel.train.__main__"
    ]
    assert importers == [], importers


def test_there_is_no_import_circle_between_modules():
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


def test_the_packages_import_one_way_in_the_documented_order():
    """Every package listed in LAYERS, and each importing only those below it and the foundations; so no two
    packages import each other and there is no circle among them."""
    graph = package_graph()
    packages = {path.parent.name for path in (ROOT / "dit_accel").glob("*/__init__.py")} - {"recipes"}
    assert packages == set(LAYERS), "place a new package in LAYERS: " + str(packages ^ set(LAYERS))
    foundations = set(graph) - set(LAYERS) - {"cli"}
    for part, imported in graph.items():
        if part == "cli":
            continue  # the dispatcher imports every command, and nothing imports it
        below = set(LAYERS[: LAYERS.index(part)]) if part in LAYERS else set()
        allowed = below | foundations - {part}
        assert imported <= allowed, f"{part} imports {sorted(imported - allowed)}, which sit above it"
    assert not any("cli" in imported for part, imported in graph.items() if part != "cli")
    for module in foundations:  # a foundation imports only other foundations
        assert graph[module] <= foundations, (module, graph[module] - foundations)


def test_the_top_of_dit_accel_holds_few_modules():
    top = sorted(path.stem for path in (ROOT / "dit_accel").glob("*.py") if path.stem != "__init__")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_every_package_says_what_it_owns_and_may_import():
    for init in (ROOT / "dit_accel").glob("*/__init__.py"):
        if init.parent.name == "recipes":
            continue
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Imports:" in docstring, f"{init}: say what the package may import (an `Imports:` paragraph)"


def test_the_training_loop_and_every_module_stay_readable():
    sizes = {
        p.relative_to(ROOT): len(p.read_text().splitlines())
        for package in ("dit_accel", "planner")
        for p in (ROOT / package).rglob("*.py")
    }
    assert sizes[Path("dit_accel/train/loop.py")] <= 300
    largest = max(sizes.items(), key=lambda kv: kv[1])
    assert largest[1] <= MAX_MODULE_LINES, largest
