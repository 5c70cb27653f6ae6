"""The package's shape: layers import only the layers before them, ops are defined once, files stay
small. (the architecture notes: 'A layer imports only layers above it in this picture.')"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import megaloop
from megaloop.frontend.opdef import REGISTRY

ROOT = Path(megaloop.__file__).parent

# What each layer may import (besides itself). Order follows the pipeline.
RUNTIME_AND_BEFORE = {
    *("core", "frontend", "models", "optim", "parallel", "fuse", "plan", "codegen", "reference", "runtime")
}
ALLOWED = {
    "core": set(),
    "frontend": {"core"},
    "models": {"core", "frontend"},
    "optim": {"core", "frontend"},  # an optimizer's ops and states attached to a training graph
    "parallel": {"core", "frontend", "optim"},  # a split training step attaches its optimizer
    "fuse": {"core", "frontend"},  # graph rewrites: run on the single-device graph or on each rank's
    "plan": {"core", "frontend", "parallel", "fuse"},
    "codegen": {"core", "frontend", "parallel", "fuse", "plan"},
    "reference": {"core", "frontend", "parallel", "fuse", "plan"},
    "runtime": {"core", "frontend", "parallel", "fuse", "plan", "codegen"},
    "generation": RUNTIME_AND_BEFORE,
    "serving": RUNTIME_AND_BEFORE | {"generation"},
    "training": RUNTIME_AND_BEFORE,  # Trainer: the training step as loop iterations, checkpoints, the command
    "api": RUNTIME_AND_BEFORE | {"generation", "serving", "training"},
}
ALLOWED["cli"] = ALLOWED["api"] | {"api"}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "megaloop":
        raise ValueError(module)
    if len(parts) == 1:
        return "api"
    if parts[1] in ("errors", "dtypes", "diskcache", "argtypes"):
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


# Packages whose modules import each other at the top only, in one direction: a lower module that needs
# something of a higher one is handed it (tensor.BUILDERS, plan.model.CONVENIENCES), never imports it.
ONE_WAY = ("megaloop.frontend", "megaloop.fuse", "megaloop.plan")


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name | ast.Attribute) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def runtime_imports(path: Path) -> tuple[set[str], list[str]]:
    """The megaloop modules ``path`` imports when it is imported (not those under ``if TYPE_CHECKING:``),
    each package whose __init__ that runs included; and "line: module" of each import inside a function."""
    modules = {module_of(p) for p in ROOT.rglob("*.py")}
    me = module_of(path)
    running = {".".join(me.split(".")[:i]) for i in range(1, me.count(".") + 2)}  # me and my packages
    found: set[str] = set()
    late: list[str] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if not node.module or node.level:
            return []
        subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
        return subs if len(subs) == len(node.names) else [*subs, node.module]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                for t in targets(child):
                    if t.split(".")[0] != "megaloop":
                        continue
                    if in_function:
                        late.append(f"{child.lineno}: {t}")
                    parts = t.split(".")
                    found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p not in running)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

    visit(ast.parse(path.read_text()), False)
    return found & modules, late


def test_no_function_level_imports_in_one_way_packages() -> None:
    """frontend/ and plan/ import megaloop modules at the top only (no imports late to dodge a cycle)."""
    bad = []
    for path in ROOT.rglob("*.py"):
        if module_of(path).startswith(ONE_WAY):
            bad += [f"{path.relative_to(ROOT.parent)}:{line}" for line in runtime_imports(path)[1]]
    assert not bad, "imports inside functions (import at the top, one way):\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = {module_of(p): runtime_imports(p)[0] for p in ROOT.rglob("*.py")}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_what_lower_modules_are_handed_is_the_public_api() -> None:
    """Tensor's operators call megaloop's (guarded) builders; Plan's conveniences the plan functions."""
    from megaloop.frontend.tensor import BUILDERS
    from megaloop.plan import format, model, stats, verify

    used = set(re.findall(r"BUILDERS\.(\w+)", (ROOT / "frontend" / "tensor.py").read_text()))
    assert used and all(getattr(BUILDERS, name) is getattr(megaloop, name) for name in used)
    used = set(re.findall(r"CONVENIENCES\.(\w+)", (ROOT / "plan" / "model.py").read_text()))
    handed = {"save": format.save, "load": format.load, "verify": verify.verify_plan, "stats": stats.plan_stats}
    assert used == set(handed) and all(getattr(model.CONVENIENCES, k) is f for k, f in handed.items())


def test_codegen_lowers_ops_by_their_opdef_alone() -> None:
    """Every op the loop kernel runs names its tile template in its OpDef (``lowering``), every such
    name is a template of megaloop.codegen.templates, and the kernel generator names no op."""
    from megaloop.codegen.templates import TEMPLATES

    lowered = {n: op.lowering.template for n, op in REGISTRY.items() if op.lowering is not None}
    missing = {n: t for n, t in lowered.items() if t not in TEMPLATES}
    assert not missing, f"lowerings naming no template: {missing}"
    tree = ast.parse((ROOT / "codegen" / "kernel.py").read_text())
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not named & set(REGISTRY), f"codegen/kernel.py names ops: {sorted(named & set(REGISTRY))}"


def test_every_fusion_rule_makes_a_registered_op_at_registered_roots() -> None:
    """Rules are declared one module a fused op (megaloop/fuse/rules/), found by reading the folder."""
    from megaloop.fuse import ordered_rules

    rules = ordered_rules()
    modules = {p.stem for p in (ROOT / "fuse" / "rules").glob("*.py") if p.stem != "__init__"}
    assert len(modules) >= 7 and {r.fire.__module__.rsplit(".", 1)[1] for r in rules} == modules
    for r in rules:
        assert r.makes in REGISTRY and set(r.roots) <= set(REGISTRY), r.name
        order = [x.name for x in rules]
        assert len(r.doc) > 20 and all(order.index(a) < order.index(r.name) for a in r.after), r.name
