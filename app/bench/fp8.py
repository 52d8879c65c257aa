"""FP8 on one GPU: W8A8 GEMM TFLOP/s per backend at DeepSeek-V3.2's projection shapes (cuBLAS
bf16 beside them, each backend's error against the torch reference; a shape with
(K / 128) % 4 != 0, which scaled_mm hands to the Triton kernel), the grouped FP8 MoE against the
bf16 one, and FP8 against bf16 on a V3.2-shaped random model (logits relative error, greedy
agreement).

    python -m app.bench.fp8 --out docs/bench/fp8.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from app.bench.fp8_moe import (
    DECODE_TILE_SWEEP,
    MOE_DECODE_SHAPES,
    MOE_LOOP_SWEEP,
    MOE_TILE_SHAPES,
    SWIGLU_LAUNCH_TOKENS,
    SWIGLU_LAUNCHES,
    moe_loop_rows,
    moe_swiglu_rows,
    moe_tile_rows,
)
from stages.forward_batch import ForwardBatch
from stages.kernels import fp8_ref
from stages.kernels.registry import select_kernels
from stages.kv_cache import make_kv_cache
from stages.loader import build_stage_model
from stages.model_config import ModelArgs
from stages.partition import layer_ranges

# (name, N, K) of V3.2's linears; M = rows of a prefill chunk or a decode batch
V32_LINEARS = [
    ("q_a", 1536, 7168),
    ("q_b", 24576, 1536),
    ("kv_a", 576, 7168),
    ("o_proj", 7168, 16384),
    ("dense gate_up", 36864, 7168),
    ("dense down", 7168, 18432),
    ("shared gate_up", 4096, 7168),
    ("shared down", 7168, 2048),
    ("K/128 = 11", 2048, 1408),
]
ROWS = (512, 4096)

# A small model with V3.2's latent (512 + 64: the FP8 layout's) and 128-aligned widths.
SMALL_V32: dict[str, Any] = {
    "model_type": "deepseek_v32",
    "vocab_size": 2048,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 512,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "index_topk": 64,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


# A small model with V4's attention widths (head dim 512 = the 584-byte FP8 layout's 448 + 64,
# window 128, CSA 4 with the indexer, HCA 128, four streams) and 128-aligned widths; a hash layer.
SMALL_V4: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": 2048,
    "hidden_size": 1024,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "head_dim": 512,
    "partial_rotary_factor": 0.125,
    "q_lora_rank": 512,
    "num_experts_per_tok": 4,
    "n_routed_experts": 16,
    "routed_scaling_factor": 1.5,
    "layer_types": [
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "hc_mult": 4,
    "sliding_window": 128,
    "o_groups": 2,
    "o_lora_rank": 256,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 64,
    "swiglu_limit": 10.0,
    "max_position_embeddings": 4096,
    "compress_rope_theta": 160000.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
SMALL_MODELS = {"v32": SMALL_V32, "v4": SMALL_V4}


class StageChain:
    """One model's stages chained in one process, each with its own cache (no Ray)."""

    def __init__(
        self,
        args: ModelArgs,
        path: str | None,
        fp8_weights: bool = False,
        kv_cache_dtype: str = "auto",
        num_stages: int = 2,
        num_blocks: int = 32,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
    ):
        self.args, self.block_size, self.device = args, block_size, device
        fp8 = ("torch" if device == "cpu" else "auto") if fp8_weights else None
        kernels = select_kernels(device, fp8_linear=fp8)
        self.stages, self.caches = [], []
        ranges = layer_ranges(args.num_hidden_layers, num_stages)
        for s, (a, b) in enumerate(ranges):
            last = s == num_stages - 1
            model = build_stage_model(args, path, a, b, s == 0, last, kernels, dtype, device, seed)
            self.stages.append(model)
            cache = make_kv_cache(
                args, range(a, b), num_blocks, block_size, dtype, device, kv_cache_dtype
            )
            self.caches.append(cache)
        self.table = list(range(num_blocks))

    @torch.no_grad()
    def logits(
        self, token_ids: list[int], rows: list[tuple[int, int, list[int], bool]]
    ) -> torch.Tensor:
        batch = ForwardBatch.build(rows, self.block_size, self.device)
        x = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        for stage, cache in zip(self.stages, self.caches):
            x = stage(x, batch, cache)
        last: Any = self.stages[-1]
        out: torch.Tensor = last.compute_logits(x[batch.sample_indices])
        return out

    def follow(
        self, prompt: list[int], chunk: int, tokens: list[int], steps: int = 0
    ) -> tuple[list[int], torch.Tensor]:
        """Chunked prefill, then one decode step per given token and `steps` greedy ones after
        them: (the tokens fed, the logits [len(tokens) + 1, V] of every sampled position)."""
        for start in range(0, len(prompt), chunk):
            piece = prompt[start : start + chunk]
            last = self.logits(piece, [(start, len(piece), self.table, True)])
        out, fed = [last[0]], list(tokens)
        for i in range(len(tokens) + steps):
            if i >= len(tokens):
                fed.append(int(out[-1].argmax()))
            out.append(self.logits([fed[i]], [(len(prompt) + i, 1, self.table, True)])[0])
        return fed, torch.stack(out)

    def greedy(self, prompt: list[int], chunk: int, steps: int) -> list[int]:
        fed, logits = self.follow(prompt, chunk, [], steps - 1)
        return [*fed, int(logits[-1].argmax())]


def accuracy(
    weights_fp8: bool,
    kv_fp8: bool,
    prompt_len: int = 256,
    steps: int = 16,
    prompts: int = 4,
    device: str = "cuda",
    base_dtype: torch.dtype = torch.bfloat16,
    model: str = "v32",
) -> dict[str, Any]:
    """FP8 against bf16 on SMALL_MODELS[model] (same random draws; FP8 weights are them
    quantized): the logits' relative error along the bf16 model's greedy path, and the fraction
    of its steps whose argmax the FP8 model shares. base_dtype float32 with nothing in FP8 gives
    the yardstick: bf16 itself against fp32."""
    from app.bench.target import kv_block_size

    args = ModelArgs.from_hf_dict(SMALL_MODELS[model])
    block = kv_block_size(SMALL_MODELS[model])
    blocks = -(-(prompt_len + steps) // block) + 1
    base = StageChain(
        args,
        None,
        num_stages=1,
        num_blocks=blocks,
        block_size=block,
        dtype=base_dtype,
        device=device,
    )
    test = StageChain(
        args,
        None,
        weights_fp8,
        "fp8" if kv_fp8 else "auto",
        num_stages=1,
        num_blocks=blocks,
        block_size=block,
        dtype=torch.bfloat16,
        device=device,
    )
    g = torch.Generator().manual_seed(3)
    errs, agree = [], []
    for _ in range(prompts):
        prompt = torch.randint(2, args.vocab_size, (prompt_len,), generator=g).tolist()
        tokens, want = base.follow(prompt, 64, [], steps)
        got = test.follow(prompt, 64, tokens)[1]
        want, got = want.float(), got.float()
        errs.append(((got - want).norm() / want.norm()).item())
        agree.append((got.argmax(-1) == want.argmax(-1)).float().mean().item())
    return {
        "model": model,
        "weights": "fp8" if weights_fp8 else "bf16",
        "kv": "fp8" if kv_fp8 else "bf16",
        "against": str(base_dtype).removeprefix("torch."),
        "prompt_len": prompt_len,
        "steps": steps,
        "prompts": prompts,
        "logits_rel_err": round(sum(errs) / len(errs), 4),
        "greedy_agreement": round(sum(agree) / len(agree), 4),
    }


# DeepSeek-V4-Flash's FP8 linears of a decode step (N, K), at decode batch sizes
V4_DECODE_LINEARS = [
    ("q_a", 1024, 4096),
    ("q_b", 32768, 1024),
    ("kv", 512, 4096),
    ("o_b", 4096, 8192),
    ("shared gate_up", 4096, 4096),
    ("shared down", 4096, 2048),
]
DECODE_ROWS = (1, 16, 64, 512)


def gemm_rows(
    rows_list: tuple[int, ...] = ROWS, linears: list[tuple[str, int, int]] = V32_LINEARS
) -> list[dict[str, Any]]:
    import triton.testing

    from stages.kernels import fp8_gemm

    backends = {
        "decode-scaled-mm": fp8_gemm.linear_decode_scaled_mm,
        "scaled-mm": fp8_gemm.linear_scaled_mm,
        "triton-persistent": fp8_gemm.linear,
        "triton-persistent-sm1": fp8_gemm.linear_sm1,
    }
    rows = []
    for m in rows_list:
        for name, n, k in linears:
            x = torch.randn(m, k, device="cuda").bfloat16()
            w = torch.randn(n, k, device="cuda") / 30
            wq, ws = fp8_ref.quantize_weight(w)
            ref = fp8_ref.linear(x.float(), wq, ws)
            flops = 2 * m * n * k
            wb = w.bfloat16()
            ms = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, wb))
            row: dict[str, Any] = {
                "layer": name,
                "M": m,
                "N": n,
                "K": k,
                "cublas_bf16_tflops": round(flops / ms / 1e9, 1),
                "cublas_bf16_us": round(ms * 1e3, 1),
            }
            for b, fn in backends.items():
                try:
                    out = fn(x, wq, ws)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    ms = triton.testing.do_bench(lambda fn=fn: fn(x, wq, ws))
                    row[b] = {
                        "tflops": round(flops / ms / 1e9, 1),
                        "us": round(ms * 1e3, 1),
                        "rel_err": round(err, 5),
                    }
                except Exception as e:  # a backend that refuses a shape is a result too
                    row[b] = {"error": f"{type(e).__name__}: {e}"[:200]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def moe_rows(tokens: int = 4096, experts: int = 32, k: int = 8) -> list[dict[str, Any]]:
    """V3.2's routed experts (hidden 7168, width 2048) over `experts` of them: the bf16 grouped
    Triton MoE against the FP8 grouped one and the per-expert FP8 loop."""
    import triton.testing

    from stages.kernels import triton_moe, triton_moe_fp8

    h, inter = 7168, 2048
    gate_up = torch.randn(experts, 2 * inter, h, device="cuda") / 60
    down = torch.randn(experts, h, inter, device="cuda") / 40
    gq, gs = fp8_ref.quantize_weight(gate_up)
    dq, ds = fp8_ref.quantize_weight(down)
    gate_up, down = gate_up.bfloat16(), down.bfloat16()
    x = torch.randn(tokens, h, device="cuda").bfloat16()
    ids = torch.rand(tokens, experts, device="cuda").topk(k, dim=-1).indices
    w = torch.rand(tokens, k, device="cuda")
    flops = 2 * tokens * k * 3 * h * inter
    runs = {
        "triton-persistent bf16": lambda: triton_moe.moe_experts(x, gate_up, down, ids, w),
        "triton-persistent fp8": lambda: triton_moe_fp8.moe_experts(x, gq, gs, dq, ds, ids, w),
        "triton-persistent-sm1 fp8": lambda: triton_moe_fp8.moe_experts_sm1(
            x, gq, gs, dq, ds, ids, w
        ),
    }
    rows = []
    for name, fn in runs.items():
        ms = triton.testing.do_bench(fn)
        row = {
            "moe": name,
            "tokens": tokens,
            "experts": experts,
            "top_k": k,
            "ms": round(ms, 3),
            "tflops": round(flops / ms / 1e9, 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--models", default="v32", help="comma-separated: " + ", ".join(SMALL_MODELS))
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--moe-tiles", action="store_true", help="only the FP8 MoE tile sweep")
    p.add_argument(
        "--moe-decode-tiles", action="store_true", help="only the sweep at decode batches"
    )
    p.add_argument(
        "--decode-linears", action="store_true", help="only V4's FP8 linears at decode rows"
    )
    p.add_argument(
        "--moe-swiglu", action="store_true", help="only the fused gate/up epilogue against unfused"
    )
    p.add_argument(
        "--moe-swiglu-launches",
        action="store_true",
        help="only the fused gate/up at 1-16 rows over (warps, stages)",
    )
    p.add_argument("--moe-loops", action="store_true", help="only the MoE GEMMs at programs an SM")
    p.add_argument(
        "--moe-loop-shapes", action="store_true", help="with --moe-loops: two launches, each shape"
    )
    p.add_argument(
        "--moe-skew",
        type=float,
        default=0.0,
        help="with --moe-loops: router logits plus this times a random popularity an expert",
    )
    p.add_argument(
        "--act-quantizers", action="store_true", help="only the activation quantizers' launches"
    )
    a = p.parse_args(argv)
    if a.act_quantizers:
        from app.bench.fp8_act import act_quantizer_rows

        rows = act_quantizer_rows()
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "act_quantizers": rows}, f)
        return 0
    if a.moe_loops:
        from stages.kernels import triton_moe_fp8 as moe

        now = (*moe.PREFILL_TILES, moe.PREFILL_PROGRAMS_PER_SM)
        launches = (
            moe_loop_rows([now, MOE_LOOP_SWEEP[-1]], MOE_TILE_SHAPES, a.moe_skew)
            if a.moe_loop_shapes  # the prefill launch against three 64-row programs an SM
            else moe_loop_rows(skew=a.moe_skew)
        )
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "launches": launches}, f)
        return 0
    if a.moe_swiglu or a.moe_swiglu_launches:
        rows = (
            moe_swiglu_rows(SWIGLU_LAUNCH_TOKENS, SWIGLU_LAUNCHES)
            if a.moe_swiglu_launches
            else moe_swiglu_rows()
        )
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "moe_swiglu": rows}, f, indent=1)
        return 0
    if a.decode_linears:
        gemms = gemm_rows(DECODE_ROWS, V4_DECODE_LINEARS)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "gemm": gemms}, f, indent=1)
        return 0
    if a.moe_tiles or a.moe_decode_tiles:
        rows = (
            moe_tile_rows(MOE_DECODE_SHAPES, DECODE_TILE_SWEEP)
            if a.moe_decode_tiles
            else moe_tile_rows()
        )
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "moe_tiles": rows}, f, indent=1)
        return 0
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if not a.skip_gemm:
        result["gemm"] = gemm_rows()
        result["moe"] = moe_rows()
    result["accuracy"] = []
    settings = (
        (False, False, torch.float32),
        (True, False, torch.bfloat16),
        (False, True, torch.bfloat16),
        (True, True, torch.bfloat16),
    )
    for model in a.models.split(","):
        for wf, kf, base in settings:
            row = accuracy(wf, kf, a.prompt_len, base_dtype=base, model=model)
            print(json.dumps(row), flush=True)
            result["accuracy"].append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
