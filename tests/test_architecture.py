"""The package's shape: layers import only the layers before them, ops are defined once, files stay
small. (the architecture notes: 'A layer imports only layers above it in this picture.')"""

from __future__ import annotations

import ast
from pathlib import Path

import megaloop
from megaloop.frontend.opdef import REGISTRY

ROOT = Path(megaloop.__file__).parent

# What each layer may import (besides itself). Order follows the pipeline.
ALLOWED = {
    "core": set(),
    "frontend": {"core"},
    "models": {"core", "frontend"},
    "parallel": {"core", "frontend"},
    "plan": {"core", "frontend", "parallel"},
    "codegen": {"core", "frontend", "parallel", "plan"},
    "reference": {"core", "frontend", "parallel", "plan"},
    "runtime": {"core", "frontend", "parallel", "plan", "codegen"},
    "generation": {"core", "frontend", "models", "parallel", "plan", "codegen", "reference", "runtime"},
    "cli": {"core", "frontend", "models", "parallel", "plan", "codegen", "reference", "runtime", "generation", "api"},
    "api": {"core", "frontend", "models", "parallel", "plan", "codegen", "reference", "runtime", "generation"},
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "megaloop":
        raise ValueError(module)
    if len(parts) == 1:
        return "api"
    if parts[1] in ("errors", "dtypes"):
        return "core"
    if parts[1] in ("cli", "__main__") or parts[1].startswith("cli_"):  # the command line and its helpers
        return "cli"
    return parts[1]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "megaloop":  # from megaloop import dtypes -> megaloop.dtypes
                found |= {f"megaloop.{a.name}" for a in node.names}
            else:
                found.add(node.module)
    return {m for m in found if m == "megaloop" or m.startswith("megaloop.")}


def test_layers_import_one_way() -> None:
    bad = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        mine = layer_of(module)
        for imported in imports_of(path):
            theirs = layer_of(imported)
            if theirs != mine and theirs not in ALLOWED[mine]:
                bad.append(f"{module} ({mine}) imports {imported} ({theirs})")
    assert not bad, "layering violations:\n" + "\n".join(bad)
    assert set(ALLOWED) >= {
        layer_of(f"megaloop.{p.name}") for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"
    }


def test_every_op_is_documented_and_exported() -> None:
    for name, op in REGISTRY.items():
        assert len(op.doc) > 10, f"op {name} needs a doc"
        if op.kind != "source":
            builder = "slice_" if name == "slice" else name
            assert hasattr(megaloop, builder), f"op {name} has no builder megaloop.{builder}"


def test_files_stay_small() -> None:
    for path in ROOT.rglob("*.py"):
        n = len(path.read_text().splitlines())
        assert n <= 800, f"{path.relative_to(ROOT)} has {n} lines; split it (STYLE.md: under ~800)"
