"""The decode reference of the bench: a plain PyTorch loop of the same model shape and batch,
replayed as one CUDA graph, with no engine around it.

Per step: embedding, every layer (RMSNorm, q/k/v, RoPE, SDPA over a dense [B, Hkv, L, D] cache
with GQA, o, RMSNorm, SwiGLU MLP), final norm, LM head and argmax. Random bf16 weights of the
model's shapes. What ppserve's decode step is measured against (issue 12's targets).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def graph_decode_step_s(
    cfg: dict[str, Any], rows: int, kv_len: int, steps: int = 50
) -> dict[str, Any]:
    """Median seconds of one replayed decode step of `rows` rows over `kv_len` keys, for the
    Hugging Face config dict `cfg` (the Llama family here, DeepSeek's MLA + MoE shapes in
    app/bench/decode_reference_mla.py); also the eager loop's median. Leaves the GPU's memory
    to the engine that starts next."""
    import torch

    from app.bench.decode_reference_mla import mla_graph_decode_step_s
    from stages.models.deepseek_config import DEEPSEEK_MODEL_TYPES

    if cfg.get("model_type") in DEEPSEEK_MODEL_TYPES:
        result = mla_graph_decode_step_s(cfg, rows, kv_len, steps)
    else:
        result = _measure(cfg, rows, kv_len, steps)
    torch.cuda.empty_cache()
    return result


def eager_and_graph_s(step: Callable[[], Any], steps: int) -> tuple[float, float]:
    """(eager, graph-replayed) median seconds of `step`: warmed on a side stream (as capture
    needs), then captured into one CUDA graph. Call it inside inference_mode."""
    import torch

    from app.bench.attention import cuda_median_ms

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    eager = cuda_median_ms(step, steps) / 1e3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return eager, cuda_median_ms(graph.replay, steps) / 1e3


def _measure(cfg: dict[str, Any], rows: int, kv_len: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    dev, dt = torch.device("cuda"), torch.bfloat16
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hq, hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // hq
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    weights = [
        dict(
            qkv=w((hq + 2 * hkv) * d, h),
            o=w(h, hq * d),
            gate_up=w(2 * inter, h),
            down=w(h, inter),
            n1=torch.ones(h, device=dev, dtype=dt),
            n2=torch.ones(h, device=dev, dtype=dt),
        )
        for _ in range(layers)
    ]
    embed, head = w(vocab, h), w(vocab, h)
    k_cache = [w(rows, hkv, kv_len, d) for _ in range(layers)]
    v_cache = [w(rows, hkv, kv_len, d) for _ in range(layers)]
    ids = torch.randint(0, vocab, (rows,), device=dev)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.full((rows,), kv_len - 1, device=dev).float()[:, None] * inv[None, :]
    cos = torch.cat((ang, ang), -1).cos().to(dt)[:, None, :]
    sin = torch.cat((ang, ang), -1).sin().to(dt)[:, None, :]

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    def step() -> torch.Tensor:
        x = embed[ids]
        for lw, kc, vc in zip(weights, k_cache, v_cache):
            qkv = F.linear(norm(x, lw["n1"]), lw["qkv"])
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
            q, k = rope(q.view(rows, hq, d)), rope(k.view(rows, hkv, d))
            kc[:, :, -1] = k
            vc[:, :, -1] = v.view(rows, hkv, d)
            o = F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=hq != hkv)
            x = x + F.linear(o.reshape(rows, hq * d), lw["o"])
            gate, up = F.linear(norm(x, lw["n2"]), lw["gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, lw["down"])
        return torch.argmax(F.linear(norm(x, torch.ones_like(x[0])), head).float(), -1)

    with torch.inference_mode():
        eager, replay = eager_and_graph_s(step, steps)
    return {"rows": rows, "kv_len": kv_len, "eager_step_s": eager, "graph_step_s": replay}
