"""Compiling a Triton kernel for an H200 (sm_90) with no GPU: triton.compile with an explicit
target and the wheel's own ptxas (the sm_90 compile tests)."""

from __future__ import annotations

from typing import Any


def compile_sm90(
    fn: Any,
    signature: dict[str, str],
    constants: dict[str, Any],
    aligned: tuple[str, ...] = (),
    **options: Any,
) -> Any:
    """fn compiled with `signature` (argument -> Triton type) and its constexprs `constants`.
    aligned: the arguments to take as multiples of 16 (bytes for a pointer), as Triton's launcher
    specializes them on the device: without them no load is vectorized, so none goes through
    the pipeliner's cp.async and the shared memory of num_stages is not what a launch needs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{name: "constexpr" for name in constants})
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(
        ASTSource(fn, sig, constants, attrs), target=GPUTarget("cuda", 90, 32), options=options
    )
