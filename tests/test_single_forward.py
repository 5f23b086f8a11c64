"""The forward pass exists once (dwarfstar/model/forward.py): no backend restates its order or borrows
another backend's model code."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import dwarfstar
from dwarfstar.model import forward

BACKENDS = Path(dwarfstar.__file__).parent / "backends"
# the steps of the forward pass; a backend function calling two of them is ordering them itself.
# `attach_image_biases` is not a step: it gives the ops weights from another file (the vision encoder's)
STAGES = frozenset(name for name, _ in inspect.getmembers(forward.Ops, inspect.isfunction)) - {
    "new_state",
    "attach_image_biases",
}
# what only `Transformer` may define: the order of the blocks and of the attention
ORDERING_METHODS = frozenset({"block", "attention", "run_layers", "compute", "hidden_batch"})
# an alias stage names another stage: a backend may import a kernel called like the op it implements
KERNEL_MODULES = frozenset({"hc_pre", "hc_post", "hc_head"})


def called_names(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            func = call.func
            if isinstance(func, ast.Attribute):
                # kernel_module.kernel(...) implements one op: the module name is not a second stage
                owner = func.value.id if isinstance(func.value, ast.Name) else None
                if owner not in KERNEL_MODULES:
                    names.add(func.attr)
            elif isinstance(func, ast.Name):
                names.add(func.id)
    return names


def self_attributes_set(func: ast.FunctionDef) -> list[str]:
    """The attributes of `self` a method assigns."""
    names = []
    for node in ast.walk(func):
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets = [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else targets
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.append(part.attr)
    return names


def problems(source: str, package: str) -> list[str]:
    """What in a backend module's source breaks the single forward pass."""
    tree, found = ast.parse(source), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dwarfstar.backends."):
            other = node.module.split(".")[2]
            if other != package and node.module.split(".")[-1] in ("model", "attention", "moe"):
                found.append(f"imports {node.module}")
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in ORDERING_METHODS:
                    found.append(f"{node.name}.{item.name} restates the forward order")
                # a step hands values on through the call's record (`batch.step`), typed in the
                # signatures: state kept on the ops object between steps is a side channel
                if isinstance(item, ast.FunctionDef) and item.name in STAGES and not item.name.startswith("_"):
                    found += [f"{node.name}.{item.name} keeps self.{a}" for a in self_attributes_set(item)]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            stages = called_names(node) & STAGES
            if len(stages) > 1:
                found.append(f"{node.name} calls the stages {sorted(stages)}")
    return found


def backend_modules() -> list[tuple[str, Path]]:
    return [(path.relative_to(BACKENDS).parts[0], path) for path in sorted(BACKENDS.rglob("*.py"))]


@pytest.mark.parametrize(("package", "path"), backend_modules(), ids=lambda v: str(v).split("backends/")[-1])
def test_backend_module_keeps_to_its_ops(package: str, path: Path) -> None:
    comparing = path.name.endswith("_bench.py") or path.name.startswith("bench_") or path.name == "parity.py"
    if comparing or path.parent == BACKENDS:
        # benches and parity tools compare a backend with the reference: they may load both models;
        # the registry (backends/registry.py, beside the packages) builds each backend's model
        assert all("restates" not in p and "calls the stages" not in p for p in problems(path.read_text(), package))
        return
    assert problems(path.read_text(), package) == []


def test_every_backend_is_the_shared_transformer() -> None:
    from dwarfstar.backends.mlx.model import MLXModel
    from dwarfstar.backends.reference.model import ReferenceModel
    from dwarfstar.backends.triton.model import TritonModel

    for cls in (ReferenceModel, TritonModel, MLXModel):
        assert issubclass(cls, forward.Transformer)


RESTATED = """
from dwarfstar.backends.reference.model import ReferenceOps

class MyModel:
    def block(self, h):
        return h

class MyOps:
    def route(self, il, x, batch):
        self.routed_x = x

def layer(ops, h, x):
    x, mix = ops.hc_pre(0, "attn", h, None)
    return ops.hc_post(h, ops.sparse_attention(0, x, None, None), mix, None)
"""


def test_the_checker_finds_a_restated_forward() -> None:
    found = problems(RESTATED, "mlx")
    assert "imports dwarfstar.backends.reference.model" in found
    assert "MyModel.block restates the forward order" in found
    assert "MyOps.route keeps self.routed_x" in found
    assert "layer calls the stages ['hc_post', 'hc_pre', 'sparse_attention']" in found
