"""Workers and the worker runtime reach the engine through one door, `EngineCore`
(engine/engine_core.py): the block pool and the scheduler are the engine's alone. mypy checks the
calls (the workers' `engine` is typed `EngineCore`, which has no pool or scheduler); this test
checks the imports and attribute names, which an untyped path would slip past."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CALLERS = ["decode_node", "prefill_node", "runtime"]
# the engine modules a caller may import: the interface, and (workers) the configs they are
# started with and a generic measuring helper; the runtime only the interface
ALLOWED = {
    "decode_node": {"engine_core", "config", "measured_choice"},
    "prefill_node": {"engine_core", "config"},
    "runtime": {"engine_core"},
}
# the engine's insides: no caller names them on anything
INSIDES = {"pool", "scheduler", "hasher", "runner", "seqs", "speculator", "grammars", "draft"}


def caller_modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def engine_modules_imported(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pdserve.engine":
                names = [a.name for a in node.names]
            elif node.module.startswith("pdserve.engine."):
                names = [node.module.removeprefix("pdserve.engine.")]
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("pdserve.engine.") for a in node.names if a.name.startswith("pdserve.engine.")]
        found.update(names)
    return found


def inside_references(tree: ast.AST) -> list[tuple[int, str]]:
    """`<x>.engine.<inside>` or `engine.<inside>` / `eng.<inside>`: an engine's insides reached."""
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in INSIDES:
            continue
        owner = node.value
        name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
        if name in ("engine", "eng"):
            bad.append((node.lineno, ast.unparse(node)))
    return bad


@pytest.mark.parametrize("package", CALLERS)
def test_callers_import_only_the_engine_interface(package):
    bad = []
    for path in caller_modules(package):
        extra = engine_modules_imported(ast.parse(path.read_text(), str(path))) - ALLOWED[package]
        if extra:
            bad.append(f"{path.relative_to(ROOT)} imports pdserve.engine.{', '.join(sorted(extra))}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", CALLERS)
def test_no_caller_reaches_into_the_engine(package):
    bad = []
    for path in caller_modules(package):
        if path.name == "settings.py":  # there `engine` is the EngineConfig (its `scheduler` is a config)
            continue
        for line, text in inside_references(ast.parse(path.read_text(), str(path))):
            bad.append(f"{path.relative_to(ROOT)}:{line}: {text}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_reach_into_the_pool():
    """The checks above would catch the calls workers used to make."""
    tree = ast.parse("self.engine.pool.free(blocks)\neng.scheduler.max_num_seqs = 3\n")
    assert sorted(t for _, t in inside_references(tree)) == ["eng.scheduler", "self.engine.pool"]
    assert engine_modules_imported(ast.parse("from pdserve.engine.block_pool import BlockPool")) == {"block_pool"}


def test_the_workers_engine_is_typed_as_the_interface():
    """mypy checks worker code against EngineCore only where the attribute is annotated so."""
    for path in [ROOT / "decode_node/worker.py", ROOT / "decode_node/colocated.py", ROOT / "prefill_node/worker.py"]:
        assert "self.engine: EngineCore = start_engine(" in path.read_text(), path
