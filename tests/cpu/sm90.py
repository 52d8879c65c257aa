"""Compiling a Triton kernel for an H200 (sm_90) with no GPU: triton.compile with an explicit
target and the wheel's own ptxas (the sm_90 compile tests)."""

from __future__ import annotations

from typing import Any

# an H100/H200 block's shared memory (227 KB): a kernel over it compiles but fails at launch
SM90_SHARED_BYTES = 232_448
# an SM's: its shared memory (228 KB, each resident block also reserving 1 KB) and registers
SM90_SM_SHARED_BYTES = 233_472
SM90_REGISTERS = 65_536


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


def registers_and_spills(kernel: Any) -> tuple[int, int]:
    """(registers a thread, bytes spilled) of a compile_sm90 kernel, from the ptxas Triton
    ships (`ptxas -v` on its PTX): spills in a kernel's loop cost it local-memory traffic."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    try:
        done = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        os.unlink(f.name)
    report = done.stdout + done.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))  # type: ignore[union-attr]
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))  # type: ignore[union-attr]
    return registers, spilled
