"""The decode reference for the DeepSeek shapes (V2/V3, V3.2): a plain PyTorch loop of the same
layers, replayed as one CUDA graph (app/bench/decode_reference.py's contract).

Per layer: RMSNorm; the queries (q LoRA with its norm, or one projection); the latent
(kv_a, its norm, the rope key) written to a dense [B, L, 576] cache; MLA in the absorbed form
(q_nope folded through W_UK, scores against the whole latent, values unfolded through W_UV) as
batched matmuls; o; RMSNorm; a dense SwiGLU on the first layers, else the router (fp32 scores,
top-k), the routed experts on ``torch._grouped_mm`` over the tokens sorted by expert (offsets
from a device-side count: no host sync) and the shared experts. V3.2 adds the indexer's key
projection and cache write; its scores are skipped while the context fits in index_topk (every
key is kept then, as the model does). Rope is applied as a rotate-half on the rope dims.
Random bf16 weights. Final norm, LM head and argmax.
"""

from __future__ import annotations

from typing import Any


def mla_graph_decode_step_s(
    cfg: dict[str, Any], rows: int, kv_len: int, steps: int
) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from app.bench.decode_reference import eager_and_graph_s
    from stages.kernels import triton_moe
    from stages.model_config import ModelArgs

    args = ModelArgs.from_hf_dict(cfg)
    d = args.family_args
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, heads, vocab = args.hidden_size, args.num_attention_heads, args.vocab_size
    rank, rope, nope, vd = d.kv_lora_rank, d.qk_rope_head_dim, d.qk_nope_head_dim, d.v_head_dim
    if d.indexer is not None and kv_len > d.indexer.topk:
        raise ValueError("the MLA reference covers contexts within index_topk only")

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=dev, dtype=dt)

    layers = []
    for i in range(args.num_hidden_layers):
        lw: dict[str, torch.Tensor] = dict(
            n1=ones(h), n2=ones(h), kv_norm=ones(rank),
            kv_a=w(rank + rope, h), w_uk=w(heads, nope, rank), w_uv=w(heads, vd, rank),
            o=w(h, heads * vd), cache=w(rows, kv_len, rank + rope),
        )  # fmt: skip
        if d.q_lora_rank is None:
            lw["q"] = w(heads * (nope + rope), h)
        else:
            lw.update(q_a=w(d.q_lora_rank, h), q_norm=ones(d.q_lora_rank))
            lw["q_b"] = w(heads * (nope + rope), d.q_lora_rank)
        if d.indexer is not None:
            lw.update(ix_k=w(d.indexer.head_dim, h), ix_cache=w(rows, kv_len, d.indexer.head_dim))
        if d.is_moe_layer(i):
            e, inter = d.n_routed_experts, d.moe_intermediate_size
            lw.update(router=torch.randn(e, h, device=dev) * 0.02, gate_up=w(e, 2 * inter, h))
            lw.update(down=w(e, h, inter))
            if d.n_shared_experts:
                shared = inter * d.n_shared_experts
                lw.update(shared_gate_up=w(2 * shared, h), shared_down=w(h, shared))
        else:
            lw.update(gate_up=w(2 * args.intermediate_size, h), down=w(h, args.intermediate_size))
        layers.append(lw)
    embed, head = w(vocab, h), w(vocab, h)
    ids = torch.randint(0, vocab, (rows,), device=dev)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, device=dev).float() / rope))
    ang = torch.full((rows,), kv_len - 1, device=dev).float()[:, None] * inv[None, :]
    cos = torch.cat((ang, ang), -1).cos().to(dt)
    sin = torch.cat((ang, ang), -1).sin().to(dt)
    k = d.num_experts_per_tok

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)

    def rot(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s

    def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x, gate_up).chunk(2, -1)
        return F.linear(F.silu(g) * u, down)

    def routed(x: torch.Tensor, lw: dict[str, torch.Tensor]) -> torch.Tensor:
        scores = F.linear(x.float(), lw["router"]).softmax(-1)
        weights, experts = scores.topk(k, dim=-1)
        if not grouped_mm:
            out: torch.Tensor = triton_moe.moe_experts(
                x, lw["gate_up"], lw["down"], experts, weights
            )
            return out
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.zeros(lw["router"].shape[0], dtype=torch.int32, device=dev)
        counts.scatter_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        token = order // k
        gu = torch._grouped_mm(x[token], lw["gate_up"].transpose(-2, -1), offs=offs)
        g, u = gu.chunk(2, -1)
        y = torch._grouped_mm(F.silu(g) * u, lw["down"].transpose(-2, -1), offs=offs)
        y = y * weights.reshape(-1)[order, None].to(dt)
        return torch.zeros_like(x).index_add_(0, token, y)

    def moe(x: torch.Tensor, lw: dict[str, torch.Tensor]) -> torch.Tensor:
        out = routed(x, lw)
        if "shared_gate_up" in lw:
            out = out + swiglu(x, lw["shared_gate_up"], lw["shared_down"])
        return out

    def attention(x: torch.Tensor, lw: dict[str, torch.Tensor]) -> torch.Tensor:
        if "q" in lw:
            q = F.linear(x, lw["q"])
        else:
            q = F.linear(norm(F.linear(x, lw["q_a"]), lw["q_norm"]), lw["q_b"])
        q_nope, q_pe = q.view(rows, heads, nope + rope).split([nope, rope], -1)
        c, k_pe = F.linear(x, lw["kv_a"]).split([rank, rope], -1)
        lw["cache"][:, -1] = torch.cat((norm(c, lw["kv_norm"]), rot(k_pe, cos, sin)), -1)
        if "ix_k" in lw:
            lw["ix_cache"][:, -1] = F.linear(x, lw["ix_k"])
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, lw["w_uk"])
        q_abs = torch.cat((q_lat, rot(q_pe, cos[:, None], sin[:, None])), -1)
        scores = torch.bmm(q_abs, lw["cache"].transpose(1, 2)).float() * (nope + rope) ** -0.5
        out = torch.bmm(scores.softmax(-1).to(dt), lw["cache"][..., :rank])
        o = torch.einsum("bhc,hvc->bhv", out, lw["w_uv"])
        return F.linear(o.reshape(rows, heads * vd), lw["o"])

    def step() -> torch.Tensor:
        x = embed[ids]
        for lw in layers:
            x = x + attention(norm(x, lw["n1"]), lw)
            y = norm(x, lw["n2"])
            x = x + (moe(y, lw) if "router" in lw else swiglu(y, lw["gate_up"], lw["down"]))
        return torch.argmax(F.linear(norm(x, ones(h)), head).float(), -1)

    grouped_mm = hasattr(torch, "_grouped_mm")
    with torch.inference_mode():
        try:
            step()
        except RuntimeError:  # a build without grouped GEMMs for this chip: ours
            grouped_mm = False
        eager, replay = eager_and_graph_s(step, steps)
    return {
        "rows": rows,
        "kv_len": kv_len,
        "eager_step_s": eager,
        "graph_step_s": replay,
        "loop": "MLA absorbed (bmm), MoE on "
        + ("torch._grouped_mm" if grouped_mm else "the Triton grouped kernel"),
    }
