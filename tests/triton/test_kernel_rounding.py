"""The kernels round as the reference does: no float division or square root whose GPU form is an
approximation. Triton compiles `/` on float32 to div.full.f32 and tl.rsqrt / tl.sqrt to rsqrt.approx /
sqrt.approx on NVIDIA (2 ulp), while its interpreter, where the suite runs, computes them exactly, so
only a GPU would show the difference; the kernels use tl.div_rn and tl.sqrt_rn (`runtime.rsqrt_rn`)."""

from __future__ import annotations

import ast
from pathlib import Path

import dwarfstar.backends.triton as triton_backend

APPROXIMATE_CALLS = ("tl.rsqrt", "tl.sqrt", "tl.math.rsqrt", "tl.math.sqrt", "tl.fdiv", "tl.math.fdiv")


def _compile_time(node: ast.expr) -> bool:
    """A constant, a constexpr (named in capitals, this code's convention) or arithmetic of those."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id.isupper()
    if isinstance(node, ast.BinOp):
        return _compile_time(node.left) and _compile_time(node.right)
    if isinstance(node, ast.UnaryOp):
        return _compile_time(node.operand)
    return False


def approximate_ops(source: str, where: str) -> list[str]:
    """Each runtime `/` and approximate square root inside a @triton.jit function of `source`."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef) or not any("jit" in ast.unparse(d) for d in fn.decorator_list):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                if not (_compile_time(node.left) and _compile_time(node.right)):
                    found.append(f"{where}:{node.lineno} {fn.name}: {ast.unparse(node)}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in APPROXIMATE_CALLS:
                found.append(f"{where}:{node.lineno} {fn.name}: {ast.unparse(node)}")
    return found


def test_no_kernel_divides_or_takes_a_root_approximately():
    root = Path(triton_backend.__file__).parent
    found = [hit for path in sorted(root.rglob("*.py")) for hit in approximate_ops(path.read_text(), path.name)]
    assert found == []


def test_the_rule_finds_a_planted_division_and_root():
    planted = (
        "@triton.jit\n"
        "def k(x, y, D: tl.constexpr):\n"
        "    a = x / y\n"
        "    b = tl.rsqrt(x) * (1.0 / D) * (1 / 120)\n"
        "    return tl.div_rn(a, y) + tl.sqrt(b)\n"
        "def host(x, y):\n"
        "    return x / y\n"
    )
    assert sorted(approximate_ops(planted, "planted.py")) == [
        "planted.py:3 k: x / y", "planted.py:4 k: tl.rsqrt(x)", "planted.py:5 k: tl.sqrt(b)",
    ]  # fmt: skip
