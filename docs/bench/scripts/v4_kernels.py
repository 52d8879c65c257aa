"""DeepSeek-V4 attention kernels at V4-Flash's shapes (64 heads, head dim 512, window 128, CSA
top-512 at rate 4, HCA every entry at rate 128) on one H200: FlashMLA's bf16 sparse prefill, its
sparse FP8 decode (window as the extra cache), the torch reference of each, and the fused Triton
quantize-on-write. Median of 20 CUDA-event timings after 3 warm-ups.

    python3 docs/bench/scripts/v4_kernels.py > docs/bench/v4_kernels.json
"""

from __future__ import annotations

import json

import torch

from stages.kernels import flash_mla_v4, fp8_v4, torch_ref, triton_fp8_latent


def ms(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[n // 2]


def ids(t: int, width: int, n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, n, (t, width), generator=g, device="cuda", dtype=torch.int32)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, scale, out = 64, 512**-0.5, {}
    sinks = torch.randn(heads, generator=g, device="cuda")
    for name, t, comp in (("csa_4k_chunk", 4096, 512), ("hca_4k_chunk_256k_ctx", 4096, 2048)):
        n = 128 + comp + 4096
        kv = (torch.randn(n, 512, generator=g, device="cuda") / 4).bfloat16()
        q = torch.randn(t, heads, 512, generator=g, device="cuda").bfloat16()
        idx = ids(t, 128 + comp, n, g)
        out[f"prefill_bf16_{name}_flash_ms"] = ms(
            lambda: flash_mla_v4.sparse_sink_attention(q, kv, idx, sinks, scale)
        )
        out[f"prefill_bf16_{name}_torch_ms"] = ms(
            lambda: torch_ref.sparse_sink_attention(q, kv, idx, sinks, scale), n=3
        )
    blocks = 2048  # 256K tokens of window pages, their CSA entries (32 per block)
    window_pages = fp8_v4.allocate(blocks, 128, "cuda")
    values = (torch.randn(blocks * 128, 512, generator=g, device="cuda") / 4).bfloat16()
    triton_fp8_latent.write_v4(window_pages, values, torch.arange(blocks * 128, device="cuda"))
    comp_pages = fp8_v4.allocate(blocks, 32, "cuda")
    triton_fp8_latent.write_v4(
        comp_pages, values[: blocks * 32], torch.arange(blocks * 32, device="cuda")
    )
    for rows in (64, 512):
        q = torch.randn(rows, heads, 512, generator=g, device="cuda").bfloat16()
        window, comp = ids(rows, 128, blocks * 128, g), ids(rows, 512, blocks * 32, g)
        args = (window_pages, window, comp_pages, comp, sinks, scale)
        out[f"decode_fp8_csa_rows{rows}_flash_ms"] = ms(
            lambda: flash_mla_v4.sparse_sink_attention_fp8(q, *args)
        )
        out[f"decode_fp8_csa_rows{rows}_torch_ms"] = ms(
            lambda: fp8_v4.sparse_sink_attention(q, *args), n=3
        )
    chunk = (torch.randn(8192, 512, generator=g, device="cuda") / 4).bfloat16()
    slots = torch.randperm(blocks * 128, generator=g, device="cuda")[:8192]
    out["write_fp8_8k_tokens_triton_ms"] = ms(
        lambda: triton_fp8_latent.write_v4(window_pages, chunk, slots)
    )
    out["write_fp8_8k_tokens_torch_ms"] = ms(
        lambda: fp8_v4.write_reference(window_pages, chunk, slots)
    )
    out["device"] = torch.cuda.get_device_name()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
