"""Compiling a Triton kernel for an H200 (sm_90) with no GPU: triton.compile with an explicit
target and the wheel's own ptxas (the sm_90 compile tests)."""

from __future__ import annotations

from typing import Any


def compile_sm90(
    fn: Any, signature: dict[str, str], constants: dict[str, Any], **options: Any
) -> Any:
    """fn compiled with `signature` (argument -> Triton type) and its constexprs `constants`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{name: "constexpr" for name in constants})
    return triton.compile(
        ASTSource(fn, sig, constants), target=GPUTarget("cuda", 90, 32), options=options
    )
