"""Programmatic dependent launch (stages/kernels/pdl.py): a kernel launched with it may start
before the kernel ahead of it finishes, so each one must wait (``enter(PDL)``) before it touches
memory. These tests hold that rule over the kernels' source (a launch with the keywords on a
kernel without the parameter fails only on a GPU), compile one kernel for sm_90 to see the
wait come first, and check that off CUDA nothing asks for PDL."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from stages.kernels import pdl

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "stages" / "kernels"


def _jit_functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {
        node.name: node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any("jit" in ast.unparse(d) for d in node.decorator_list)
    }


def _launched_with_pdl(tree: ast.AST) -> list[str]:
    """The kernels launched as name[grid](..., **pdl.options(...))."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
            if any(k.arg is None and "pdl.options" in ast.unparse(k.value) for k in node.keywords):
                names.append(ast.unparse(node.func.value).removesuffix("()"))
    return names


def test_every_pdl_launch_is_of_a_kernel_that_waits_first():
    launched_total = 0
    for path in sorted(set(KERNELS.glob("*.py")) - {KERNELS / "pdl.py"}):
        tree = ast.parse(path.read_text())
        kernels = _jit_functions(tree)
        for name, fn in kernels.items():
            params = [a.arg for a in fn.args.args]
            if "PDL" not in params:
                continue
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(
                fn.body[0].value, ast.Constant
            ) else fn.body  # fmt: skip
            first = ast.unparse(body[0])
            assert first in ("enter(PDL)", "pdl.enter(PDL)"), (path.name, name, first)
        factories = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for name in _launched_with_pdl(tree):
            launched_total += 1
            if name in kernels:
                launched = [kernels[name]]
            else:  # a factory's kernel (built on first use): the jit functions inside it
                launched = list(_jit_functions(factories[name]).values())
            assert launched, (path.name, name)
            for kernel in launched:
                assert "PDL" in [a.arg for a in kernel.args.args], (path.name, name)
    assert launched_total >= 25  # the decode step's kernels and the prefill's


def test_off_cuda_no_launch_asks_for_pdl(monkeypatch):
    assert pdl.options(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.options(torch.zeros(1)) == {"PDL": False}


def test_a_pdl_kernel_waits_before_its_first_load():
    """_combine compiled for sm_90 with PDL: griddepcontrol.wait, then launch_dependents, come
    before any global load or store; without PDL neither is there."""
    pytest.importorskip("triton")
    from stages.kernels import triton_moe_combine
    from tests.cpu.sm90 import compile_sm90

    signature = {
        "y_ptr": "*bf16", "ids_ptr": "*i64", "out_ptr": "*bf16", "T": "i32", "H": "i32",
        "stride_y": "i32", "stride_ids": "i32", "stride_out": "i32",
    }  # fmt: skip
    constants = {"K": 6, "BLOCK_T": 4, "BLOCK_H": 512}
    ptx = compile_sm90(
        triton_moe_combine._combine, signature, {**constants, "PDL": True}, num_warps=4
    ).asm["ptx"]
    wait, dependents = (
        ptx.index("griddepcontrol.wait"),
        ptx.index("griddepcontrol.launch_dependents"),
    )
    memory = min(ptx.index(op) for op in ("ld.global", "st.global") if op in ptx)
    assert wait < dependents < memory
    plain = compile_sm90(
        triton_moe_combine._combine, signature, {**constants, "PDL": False}, num_warps=4
    ).asm["ptx"]
    assert "griddepcontrol" not in plain
