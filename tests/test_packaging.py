"""The distribution installs one import name, `pdserve`, and its layers point one way."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> the pdserve packages it must not import (directly, at any depth)
FORBIDDEN = {
    "protocol": {"engine", "kernels", "kvtransfer", "gateway", "prefill_node", "decode_node", "bench", "cli"},
    "kvtransfer": {"engine", "kernels", "gateway", "prefill_node", "decode_node", "bench", "cli"},
    "kernels": {"engine", "kvtransfer", "gateway", "prefill_node", "decode_node", "bench", "cli"},
    "engine": {"gateway", "prefill_node", "decode_node", "bench", "cli", "runtime", "modelgen"},
    "modelgen": {"gateway", "prefill_node", "decode_node", "bench", "cli", "runtime", "kvtransfer"},
    # (and of the engine only its interface, engine/engine_core.py: tests/test_engine_boundary.py)
    "runtime": {"kernels", "kvtransfer", "gateway", "prefill_node", "decode_node", "bench", "cli"},
    "gateway": {"prefill_node", "decode_node", "kvtransfer", "kernels", "cli", "runtime"},
    "prefill_node": {"decode_node", "gateway", "cli"},
    "decode_node": {"prefill_node", "gateway", "cli"},
}


def project_sources() -> list[Path]:
    """The project's own .py files: none under a hidden folder (.git, a .venv made in the
    checkout as many users do) or a build output."""
    return [
        path
        for path in sorted(ROOT.rglob("*.py"))
        if not any(part.startswith(".") or part in ("build", "dist") for part in path.relative_to(ROOT).parts[:-1])
    ]


FOLDERS = {
    "protocol": "protocol",
    "kvtransfer": "kvtransfer",
    "kernels": "kernels",
    "engine": "engine",
    "gateway": "gateway",
    "prefill_node": "prefill_node",
    "decode_node": "decode_node",
    "runtime": "runtime",
    "modelgen": "modelgen",
}


def package_files() -> set[str]:
    """Every file of the `pdserve` package as a wheel names it: pdserve/ walked through its links."""
    found = set()
    for folder, dirs, files in os.walk(ROOT / "pdserve", followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = Path(folder).relative_to(ROOT)
        found |= {(rel / f).as_posix() for f in files if f.endswith((".py", ".c", ".h"))}
    return found


def test_import_names_are_paths():
    """One layout rule: `pdserve.X` is `pdserve/X`, a link to the top-level folder `X/` where it
    lives; every top-level package folder is linked (nothing reachable only by a mapping)."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"pdserve", "tests"}
    links = {p.name for p in (ROOT / "pdserve").iterdir() if p.is_symlink()}
    assert links == packages, f"linked {sorted(links)}, top-level packages {sorted(packages)}"
    for name in links:
        assert os.readlink(ROOT / "pdserve" / name) == f"../{name}", name


def imported_pdserve_packages(path: Path) -> set[str]:
    """Second-level names of every `pdserve.X` a module imports (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "pdserve":
                found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "pdserve" and len(parts) > 1:
                    found.add(parts[1])
    return found


@pytest.mark.parametrize("package", list(FORBIDDEN))
def test_layers_point_one_way(package):
    bad = []
    for path in sorted((ROOT / FOLDERS[package]).rglob("*.py")):
        wrong = imported_pdserve_packages(path) & FORBIDDEN[package]
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports pdserve.{', pdserve.'.join(sorted(wrong))}")
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_bare_top_level_name():
    """Everything goes through `pdserve.`; a stray `from engine import` works only from the repo root."""
    names = set(FOLDERS) | {"bench", "cli", "pdserve_cli"}
    bad = []
    for path in project_sources():
        if "tests" in path.relative_to(ROOT).parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            bad += [f"{path.relative_to(ROOT)}: {m}" for m in mods if m.split(".")[0] in names]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_wheel_installs_only_pdserve(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    shutil.copytree(
        ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "docs")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        timeout=600,
    )
    wheel = next(tmp_path.glob("pdserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    others = {n.split("/")[0] for n in names} - {"pdserve"}
    assert len(others) == 1 and others.pop().endswith(".dist-info"), names
    missing = package_files() - set(names)  # e.g. a subpackage a hand-kept package list forgot
    assert not missing, sorted(missing)
    assert "pdserve/kernels/cpu_decode_attention.c" in names
    assert not any(n.startswith("pdserve/tests") for n in names)


def test_environment_is_read_in_one_module():
    """pdserve/env.py reads the environment once; nothing else reads it (hot paths included)."""
    bad = []
    for path in project_sources():
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "bench") or rel == Path("pdserve/env.py"):
            continue
        text = path.read_text()
        bad += [f"{rel}: {pattern}" for pattern in ("os.environ.get(", "os.environ[", "os.getenv(") if pattern in text]
    assert not bad, "\n".join(bad)
