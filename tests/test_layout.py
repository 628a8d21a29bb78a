"""The layout holds: packages import downwards only (docs/architecture.md), and the scheduler,
the simulator and the benchmarks meet through `conductor.scheduler`'s public surface."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("conductor", "conductorctl", "embedded", "worker", "prefill_worker",
            "decode_worker", "store", "cluster", "simulator", "tinymodel", "benchmarks")
SCHEDULER = "conductor.scheduler"


def _modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in mods else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in mods}


def _package(module: str) -> str:
    return SCHEDULER if module.startswith(SCHEDULER) else module.split(".")[0]


def _graph() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the modules that import it."""
    mods = _modules()
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, path in mods.items():
        for target in _imports(path, mods):
            if _package(target) != _package(name):
                graph[_package(name)][_package(target)].add(name)
    return {package: dict(targets) for package, targets in graph.items()}


def test_no_package_imports_one_that_imports_it_back() -> None:
    graph = _graph()
    cycles = [(a, b, sorted(graph[a][b]), sorted(graph[b][a]))
              for a in graph for b in graph[a] if a < b and a in graph.get(b, {})]
    assert not cycles, cycles


def test_the_scheduler_imports_nothing_of_the_conductor_above_it() -> None:
    graph = _graph()
    assert "conductor" not in graph.get(SCHEDULER, {}), graph.get(SCHEDULER)


def test_the_simulator_and_the_benchmarks_use_the_schedulers_public_surface() -> None:
    mods = _modules()
    deep = {(name, target) for name, path in mods.items()
            if name.startswith(("simulator", "benchmarks"))
            for target in _imports(path, mods) if target.startswith(SCHEDULER + ".")}
    assert not deep, sorted(deep)


def test_the_launcher_and_the_cli_sit_above_what_they_start() -> None:
    """`embedded` starts the conductor and the workers as processes, `conductorctl` calls the
    admin API: nothing they start imports them."""
    graph = _graph()
    above = {"embedded", "conductorctl"}
    leaks = {p: sorted(above & set(graph.get(p, {}))) for p in PACKAGES + (SCHEDULER,)
             if p not in above | {"benchmarks"} and above & set(graph.get(p, {}))}
    assert not leaks, leaks
