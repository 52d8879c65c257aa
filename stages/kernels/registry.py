"""Kernel backends per operation: a static table of lazy imports and an "auto" choice.

Each backend is "module:attr" naming the op; its module may define `is_available(device)`, and
`supports(op, target)`, which refuses a model whose shapes or dtype it cannot serve
(stages/kernels/fallbacks.py). Nothing is imported until chosen, so optional GPU packages never
load on CPU.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable

from stages.kernels.fallbacks import KernelTarget, OpShape, Refusal, record_fallback

if TYPE_CHECKING:
    from stages.model_config import ModelArgs

log = logging.getLogger(__name__)

BACKENDS: dict[str, dict[str, str]] = {
    "linear": {
        "torch": "stages.kernels.torch_ref:linear",
        "triton-persistent": "stages.kernels.triton_gemm:linear",
        # Persistent grid of SM count - 1: leaves an SM free for the NCCL kernel
        # (docs/ARCHITECTURE.md#kernel-backends).
        "triton-persistent-sm1": "stages.kernels.triton_gemm:linear_sm1",
    },
    "attention": {
        "torch": "stages.kernels.torch_ref:attention",
        "cudnn": "stages.kernels.cudnn_attention:attention",
    },
    # One call for a padded group of decode rows (one query each).
    "decode_attention": {
        "torch": "stages.kernels.torch_ref:decode_attention",
    },
    # Decode rows reading K/V in place through block tables (static shapes: CUDA graphs).
    "paged_decode": {
        "triton": "stages.kernels.triton_paged_decode:paged_decode_attention",
        "torch": "stages.kernels.torch_ref:paged_decode_attention",
    },
    # MLA (DeepSeek) decode in the absorbed form over the paged latent cache.
    "mla_decode": {
        "torch": "stages.kernels.torch_ref:mla_decode",
        "flash-mla": "stages.kernels.flash_mla:mla_decode",
    },
    # DeepSeek-V3.2 sparse MLA (absorbed form) over the indexer's selected latent slots.
    "mla_sparse": {
        "torch": "stages.kernels.torch_ref:mla_sparse",
        "flash-mla": "stages.kernels.flash_mla:mla_sparse",
    },
    # DeepSeek-V3.2 lightning-indexer scores of queries against a row's prefix keys.
    "indexer_logits": {
        "torch": "stages.kernels.torch_ref:indexer_logits",
        "triton": "stages.kernels.triton_indexer:indexer_logits",
    },
    # The same scores for every selecting row of a batch at once, through each row's slot table
    # (stages.kernels.indexer_select).
    "indexer_logits_rows": {
        "torch": "stages.kernels.indexer_select:logits_rows_reference",
        "triton": "stages.kernels.triton_indexer:indexer_logits_rows",
    },
    # The indexer's top-k under the selection rule (indexer_select.top_k_positions): torch's
    # top-k then the rule's order, or a threshold from group maxima and a Triton compaction of
    # the candidates first (long lines).
    "index_topk": {
        "torch": "stages.kernels.indexer_select:top_k_positions",
        "triton": "stages.kernels.triton_topk:top_k_positions",
    },
    # DeepSeek-V4 attention: a K=V head over selected keys (window + compressed), with sinks.
    "sparse_sink_attention": {
        "torch": "stages.kernels.torch_ref:sparse_sink_attention",
        "flash-mla": "stages.kernels.flash_mla_v4:sparse_sink_attention",
    },
    # The same over the 584-byte FP8 pages in place (stages/kernels/fp8_v4.py): the window's and
    # the compressed entries' slot ids per query.
    "sparse_sink_attention_fp8": {
        "torch": "stages.kernels.fp8_v4:sparse_sink_attention",
        "flash-mla": "stages.kernels.flash_mla_v4:sparse_sink_attention_fp8",
    },
    # Routed MoE experts: per-expert cuBLAS GEMMs, or one grouped persistent Triton kernel.
    "moe_experts": {
        "torch": "stages.kernels.torch_ref:moe_experts",
        "triton-persistent": "stages.kernels.triton_moe:moe_experts",
        "triton-persistent-sm1": "stages.kernels.triton_moe:moe_experts_sm1",
    },
    # DeepSeek-V4's hyper-connections: the streams' mix (pre / post / Sinkhorn comb, the
    # collapsed block input) and their merge with the block's output.
    "hc_mix": {
        "torch": "stages.kernels.hyper_connection:mix",
        "triton": "stages.kernels.triton_hyper:mix",
    },
    "hc_merge": {
        "torch": "stages.kernels.hyper_connection:merge",
        "triton": "stages.kernels.triton_hyper:merge",
    },
    # DeepSeek-V4's rope on a head's trailing channels, in place, optionally after the head's
    # unweighted RMS norm (its queries).
    "rope_tail": {
        "torch": "stages.kernels.rope_tail:rope_tail",
        "triton": "stages.kernels.triton_rope:rope_tail",
    },
    # DeepSeek-V4's compression of a group of tokens into one entry (softmax-gated pooling).
    "group_pool": {
        "torch": "stages.kernels.group_pool:pool_groups",
        "triton": "stages.kernels.triton_group_pool:pool_groups",
    },
    # DeepSeek-V4's router after its gate GEMM: scores, the biased top-k (or a hash layer's
    # ids), the weights renormalised and scaled.
    "route_topk": {
        "torch": "stages.kernels.route_topk:route_topk",
        "triton": "stages.kernels.triton_route_topk:route_topk",
    },
    # The index arithmetic of a DeepSeek-V4 decode step on its graphs' static buffers.
    "v4_window_index": {
        "torch": "stages.kernels.v4_paged_index:window_index",
        "triton": "stages.kernels.triton_v4_paged_index:window_index",
    },
    "v4_rate_index": {
        "torch": "stages.kernels.v4_paged_index:rate_index",
        "triton": "stages.kernels.triton_v4_paged_index:rate_index",
    },
    # A CSA layer's picked entries -> their cache slots, for the FP8 attention's decode rows.
    "v4_pick_slots": {
        "torch": "stages.kernels.v4_paged_index:pick_slots",
        "triton": "stages.kernels.triton_v4_paged_index:pick_slots",
    },
    # DeepSeek-V4's rotary angles at a forward's positions, as rope_tail takes them.
    "rope_angles": {
        "torch": "stages.kernels.rope_tail:rope_angles",
        "triton": "stages.kernels.triton_rope:rope_angles",
    },
    # DeepSeek-V4's RMSNorm (its weight in fp32, the product in fp32, cast once).
    "rms_norm_fp32": {
        "torch": "stages.kernels.rope_tail:fp32_rms_norm",
        "triton": "stages.kernels.triton_rope:rms_norm",
    },
    # W8A8 linears over block-scaled FP8 weights (128 x 128 scales, activations in 1 x 128).
    "fp8_linear": {
        "torch": "stages.kernels.fp8_ref:linear",
        "decode-scaled-mm": "stages.kernels.fp8_gemm:linear_decode_scaled_mm",
        "scaled-mm": "stages.kernels.fp8_gemm:linear_scaled_mm",
        "triton-persistent": "stages.kernels.fp8_gemm:linear",
        "triton-persistent-sm1": "stages.kernels.fp8_gemm:linear_sm1",
    },
    # A SwiGLU's W8A8 down projection fed its gate | up: the swiglu folded into the activations'
    # quantizer (the same backends as fp8_linear, chosen with it).
    "fp8_swiglu_linear": {
        "torch": "stages.kernels.fp8_ref:swiglu_linear",
        "decode-scaled-mm": "stages.kernels.fp8_gemm:swiglu_linear_decode_scaled_mm",
        "scaled-mm": "stages.kernels.fp8_gemm:swiglu_linear_scaled_mm",
        "triton-persistent": "stages.kernels.fp8_gemm:swiglu_linear",
        "triton-persistent-sm1": "stages.kernels.fp8_gemm:swiglu_linear_sm1",
    },
    # Routed experts with FP8 weights: a grouped persistent W8A8 Triton GEMM, or (torch) each
    # expert's GEMMs on the chosen fp8_linear; deepgemm: a prefill chunk's two grouped GEMMs on
    # DeepGEMM's (built from source: it is not on the package index), the same bits.
    "moe_experts_fp8": {
        "torch": "stages.kernels.fp8_ref:moe_experts",
        "deepgemm": "stages.kernels.deepgemm_moe:moe_experts",
        "triton-persistent": "stages.kernels.triton_moe_fp8:moe_experts",
        "triton-persistent-sm1": "stages.kernels.triton_moe_fp8:moe_experts_sm1",
    },
    # Routed experts with MXFP4 weights kept packed (DeepSeek-V4's): a grouped persistent W4A16
    # Triton GEMM dequantizing in the kernel, or (torch) each expert dequantized per call.
    "moe_experts_mxfp4": {
        "torch": "stages.kernels.mxfp4:moe_experts",
        "triton-persistent": "stages.kernels.triton_moe_mxfp4:moe_experts",
        "triton-persistent-sm1": "stages.kernels.triton_moe_mxfp4:moe_experts_sm1",
    },
    # DeepSeek-V3.2 sparse MLA over the 656-byte FP8 latent pages (fp8_latent's layout).
    "mla_sparse_fp8": {
        "torch": "stages.kernels.fp8_latent:mla_sparse",
        "flash-mla": "stages.kernels.flash_mla:mla_sparse_fp8",
    },
    # The same contract for forwards holding a prefill chunk: the batch's prefix keys
    # dequantized to bf16 for FlashMLA's sparse prefill kernel (flash-mla-bf16), or every query
    # a row of the FP8 decode kernel (flash-mla: SGLang's flashmla_kv prefill; that kernel slows
    # ~1.9x beside a waiting recv, the bf16 prefill kernel not: docs/PERFORMANCE.md). V4 follows
    # the choice (fp8_prefill_in_place).
    "mla_prefill_fp8": {
        "torch": "stages.kernels.fp8_latent:mla_sparse",
        "flash-mla-bf16": "stages.kernels.flash_mla:mla_sparse_fp8_via_bf16",
        "flash-mla": "stages.kernels.flash_mla:mla_sparse_fp8",
    },
}

# "auto" takes the first available; torch (cuBLAS) stays first for linear until a backend beats it;
# cuDNN leads attention on CUDA (faster than SDPA's flash path on chunks: docs/PERFORMANCE.md).
PRIORITY: dict[str, tuple[str, ...]] = {
    "linear": ("torch", "triton-persistent"),
    "attention": ("cudnn", "torch"),
    "decode_attention": ("torch",),
    "paged_decode": ("triton", "torch"),
    "mla_decode": ("flash-mla", "torch"),
    "mla_sparse": ("flash-mla", "torch"),
    "indexer_logits": ("triton", "torch"),
    "indexer_logits_rows": ("triton", "torch"),
    "index_topk": ("triton", "torch"),
    "moe_experts": ("triton-persistent", "torch"),
    "sparse_sink_attention": ("flash-mla", "torch"),
    "sparse_sink_attention_fp8": ("flash-mla", "torch"),
    "hc_mix": ("triton", "torch"),
    "hc_merge": ("triton", "torch"),
    "rope_tail": ("triton", "torch"),
    "rms_norm_fp32": ("triton", "torch"),
    "rope_angles": ("triton", "torch"),
    "group_pool": ("triton", "torch"),
    "route_topk": ("triton", "torch"),
    "v4_window_index": ("triton", "torch"),
    "v4_rate_index": ("triton", "torch"),
    "v4_pick_slots": ("triton", "torch"),
    # up to 32 rows the decode kernel (the same bits as cuBLASLt's unsplit GEMM; with the swapped
    # experts a one-row V4 step 2.23 against 2.35 ms on an H100, session 34), more cuBLASLt
    "fp8_linear": ("decode-scaled-mm", "scaled-mm", "triton-persistent", "torch"),
    "fp8_swiglu_linear": ("decode-scaled-mm", "scaled-mm", "triton-persistent", "torch"),
    "moe_experts_fp8": ("deepgemm", "triton-persistent", "torch"),
    "moe_experts_mxfp4": ("triton-persistent", "torch"),
    "mla_sparse_fp8": ("flash-mla", "torch"),
    "mla_prefill_fp8": ("flash-mla-bf16", "flash-mla", "torch"),
}


@dataclass(frozen=True)
class Kernels:
    linear: Callable[..., Any]  # (x, weight, bias=None) -> x @ weight.T + bias
    # (q [t,Hq,D], k [L,Hkv,D], v [L,Hkv,Dv], scale) -> [t,Hq,Dv]
    attention: Callable[..., Any]
    # (q [R,Hq,D], k/v [R,Lmax,Hkv,D], mask [R,Lmax], scale)
    decode_attention: Callable[..., Any]
    # (q [R,Hq,D], k/v cache [slots,Hkv,D], tables, table_rows [R], lengths [R], scale, block)
    paged_decode: Callable[..., Any]
    # (q [R,H,576], pages [blocks,B,1,576], block_table, seqlens, dv, scale, state) -> [R,H,dv]
    mla_decode: Callable[..., Any] | None = None
    # (x [T,H], gate_up [E,2I,H], down [E,H,I], topk_ids [T,k] (-1: a pick none of these
    #  experts runs, skipped), topk_weights [T,k], limit=None: DeepSeek-V4's swiglu clamp) -> [T,H]
    moe_experts: Callable[..., Any] | None = None
    # (q [T,H,576], kv [slots,1,576], indices [T,topk] int32 slot ids (-1: none), dv, scale)
    # -> [T,H,dv] in q's dtype: FlashMLA's flash_mla_sparse_fwd contract
    mla_sparse: Callable[..., Any] | None = None
    # (q [T,Hi,D], k [L,D], weights [T,Hi] fp32, scale) -> [T,L] fp32:
    # sum_h weights[t,h] * relu(scale * q[t,h].k[l]); the model masks causally, takes top-k
    indexer_logits: Callable[..., Any] | None = None
    # (q [Ts,Hi,D], keys [slots,D], weights [Ts,Hi] fp32, scale, SelectPlan, maxima=None)
    # -> [Ts,Lmax] fp32, -inf where a token does not see the key; maxima: a buffer
    # (indexer_select.maxima_buffer) also filled with the scores' group maxima
    indexer_logits_rows: Callable[..., Any] | None = None
    # (scores [N, L] fp32, k, maxima=None) -> [N, k] long: each line's top k positions under
    # the selection rule (highest score, then lower position), in that order; maxima: the
    # scores' group maxima where the scores op wrote them
    index_topk: Callable[..., Any] | None = None
    # (q [T,H,D], kv [N,D], indices [T,K] (-1: none), sinks [H] fp32, scale) -> [T,H,D]
    sparse_sink_attention: Callable[..., Any] | None = None
    # (q [T,H,512], window pages [blocks,B,1,584], window [T,K] slot ids (-1: none),
    #  comp pages | None, comp [T,E] | None, sinks [H] fp32, scale, state=None,
    #  window_state=None) -> [T,H,512]; state: a dict passed again only with the same window
    #  and comp, window_state only with the same window, where a backend keeps what it
    #  derives from them
    sparse_sink_attention_fp8: Callable[..., Any] | None = None
    # (streams [T,N,D], fn [(2+N)N, ND], base [(2+N)N], scale [3] fp32, iters, eps, norm_eps,
    #  out_norm=(weight [D] fp32, eps) | None) -> (post [T,N] fp32, comb [T,N,N] fp32,
    #  collapsed [T,D], normed by out_norm when given); stages/kernels/hyper_connection
    hc_mix: Callable[..., Any] | None = None
    # (streams [T,N,D], out [T,D], post [T,N], comb [T,N,N]) -> [T,N,D]
    hc_merge: Callable[..., Any] | None = None
    # (x [T,D] or [T,H,D], cos [T,r] fp32, sin [T,r] fp32 signed, norm_eps | None) -> x, in
    # place: stages/kernels/rope_tail
    rope_tail: Callable[..., Any] | None = None
    # (x [..., D], weight [D] fp32, eps) -> [..., D] in x's dtype: rope_tail.fp32_rms_norm
    rms_norm_fp32: Callable[..., Any] | None = None
    # (positions [N], inv_freq [r/2] fp32, scaling, dtype) -> (cos [N, r], signed sin [N, r])
    # fp32 per channel: rope_tail.rope_angles
    rope_angles: Callable[..., Any] | None = None
    # (inputs [S, 2*series*w], slots [G, 2*rate] long, first [G] bool, bias [rate, series*w]
    #  fp32, rate, overlap, live [G] bool | None) -> [G, w]: stages/kernels/group_pool
    group_pool: Callable[..., Any] | None = None
    # (logits [T, E], k, scoring, scale, bias [E] fp32 | None, ids [T, k] | None) ->
    # (weights [T, k] in logits' dtype, ids [T, k] long): stages/kernels/route_topk
    route_topk: Callable[..., Any] | None = None
    # a V4 decode step's index arithmetic (positions, lengths, table_rows, block_tables,
    # block_size, window[, rate, most, dense, scratch_slot]) -> WindowIndex / RateIndex:
    # stages/kernels/v4_paged_index
    v4_window_index: Callable[..., Any] | None = None
    v4_rate_index: Callable[..., Any] | None = None
    v4_pick_slots: Callable[..., Any] | None = None
    # (x [..., K], weight [N, K] fp8, scale_inv [N/128, K/128] fp32, bias) -> [..., N]; set
    # only when FP8 weights stay FP8 (Linear then holds them so)
    fp8_linear: Callable[..., Any] | None = None
    # (gate_up [..., 2I], limit | None, weight [N, I] fp8, scale_inv, bias) -> [..., N]:
    # fp8_linear(torch_ref.swiglu(gate, up, limit), ...), set with fp8_linear
    fp8_swiglu_linear: Callable[..., Any] | None = None
    # moe_experts with FP8 weights and their scales (fp8_ref.moe_experts's arguments, limit
    # included)
    moe_experts_fp8: Callable[..., Any] | None = None
    # (x [T,H], gate_up [E,2I,H/2] uint8 e2m1 pairs, its e8m0 scales [E,2I,H/32] uint8, down
    #  [E,H,I/2], its scales [E,H,I/32], topk_ids, topk_weights, limit=None) -> [T,H]: MXFP4
    #  experts kept packed (stages/kernels/mxfp4.py)
    moe_experts_mxfp4: Callable[..., Any] | None = None
    # (q [T,H,576], pages [blocks,B,1,656] uint8, indices [T,topk] int32, dv, scale, state)
    # -> [T,H,dv]: set only for an FP8 latent cache
    mla_sparse_fp8: Callable[..., Any] | None = None
    # mla_sparse_fp8's contract, for forwards holding a prefill chunk (the dequantizing backend
    # reads the chunks' prefix keys from state: flash_mla.PREFIX_KEYS)
    mla_prefill_fp8: Callable[..., Any] | None = None
    names: dict[str, str] = field(default_factory=dict)  # op -> backend chosen


def _load(op: str, name: str, device: str) -> tuple[Callable[..., Any], ModuleType] | None:
    """The backend's function and module if it imports and reports available on `device`."""
    module_name, attr = BACKENDS[op][name].split(":")
    try:
        module = importlib.import_module(module_name)
        fn = getattr(module, attr)
        available = getattr(module, "is_available", lambda _d: True)(device)
    except Exception as e:  # a missing or broken optional package only disqualifies it
        log.debug("kernel backend %s/%s unusable: %r", op, name, e)
        return None
    return (fn, module) if available else None


def _refusal(op: str, module: ModuleType, target: KernelTarget | None) -> Refusal | None:
    """The backend module's `supports` verdict on the stage's target (None: no objection)."""
    supports = getattr(module, "supports", None)
    if target is None or supports is None:
        return None
    refusal: Refusal | None = supports(op, target)
    return refusal


def _select(
    op: str, choice: str, device: str, target: KernelTarget | None = None
) -> tuple[str, Callable[..., Any]]:
    table = BACKENDS[op]
    if choice == "auto":
        for name in PRIORITY[op]:
            loaded = _load(op, name, device)
            if loaded is None:
                continue
            refusal = _refusal(op, loaded[1], target)
            if refusal is None:
                return name, loaded[0]
            record_fallback(op, name, refusal.reason, f"declined for this model: {refusal.detail}")
        fallback = _load(op, "torch", device)
        if fallback is None:
            raise RuntimeError(f"the torch reference backend of {op} failed to load")
        return "torch", fallback[0]
    if choice not in table:
        raise ValueError(
            f"unknown {op} backend {choice!r}; choose auto or {', '.join(sorted(table))}"
        )
    loaded = _load(op, choice, device)
    if loaded is None:
        raise ValueError(f"{op} backend {choice!r} is not available on device {device!r}")
    refusal = _refusal(op, loaded[1], target)
    if refusal is not None:
        raise ValueError(
            f"{op} backend {choice!r} cannot serve this model ({refusal.reason}): "
            f"{refusal.detail}; choose auto or torch"
        )
    return choice, loaded[0]


def kernel_target(args: ModelArgs, dtype: str, block_size: int) -> KernelTarget:
    """What a stage of this model asks of its kernels: the shapes its family declares per op,
    and its dense chunk attention's (Family.chunk_attention_dims). A rank of a tensor-parallel
    stage passes its Family.rank_args (its share of the heads)."""
    family = args.family
    dims = family.chunk_attention_dims(args)
    dense = {} if dims is None else {"attention": OpShape(dims.heads, dims.qk_dim, dims.v_dim)}
    return KernelTarget({**dense, **family.op_shapes(args)}, dtype, block_size)


def select_kernels(
    device: str,
    linear: str = "auto",
    attention: str = "auto",
    mla_decode: str = "auto",
    moe_experts: str = "auto",
    mla_sparse: str = "auto",
    indexer_logits: str = "auto",
    fp8_linear: str | None = None,
    mla_sparse_fp8: str = "auto",
    mla_prefill_fp8: str = "auto",
    target: KernelTarget | None = None,
) -> Kernels:
    """Pick one backend per op for `device`; an explicit name that cannot run is an error.
    fp8_linear is chosen only where FP8 weights stay FP8 (None leaves it unset, and Linear
    layers then hold their weights in the model's dtype); it brings moe_experts_fp8. With a
    `target` (kernel_target), a backend whose `supports` refuses the model is declined under
    "auto" (logged and counted: stages/kernels/fallbacks.py) and an error when named."""
    optional = {
        "fp8_linear": fp8_linear,
        "fp8_swiglu_linear": fp8_linear,
        "mla_sparse_fp8": mla_sparse_fp8,
        "mla_prefill_fp8": mla_prefill_fp8,
        "moe_experts_fp8": None if fp8_linear is None else moe_backend_for(fp8_linear),
    }
    chosen = {
        op: _select(op, choice, str(device), target)
        for op, choice in (
            ("linear", linear),
            ("attention", attention),
            ("decode_attention", "auto"),
            ("paged_decode", "auto"),
            ("mla_decode", mla_decode),
            ("moe_experts", moe_experts),
            ("moe_experts_mxfp4", moe_experts),
            ("mla_sparse", mla_sparse),
            ("indexer_logits", indexer_logits),
            ("indexer_logits_rows", indexer_logits),
            ("index_topk", indexer_logits),
            ("sparse_sink_attention", "auto"),
            ("sparse_sink_attention_fp8", "auto"),
            ("hc_mix", "auto"),
            ("hc_merge", "auto"),
            ("rope_tail", "auto"),
            ("rms_norm_fp32", "auto"),
            ("rope_angles", "auto"),
            ("group_pool", "auto"),
            ("route_topk", "auto"),
            ("v4_window_index", "auto"),
            ("v4_rate_index", "auto"),
            ("v4_pick_slots", "auto"),
            *((op, choice) for op, choice in optional.items() if choice is not None),
        )
    }
    names = {op: name for op, (name, _fn) in chosen.items()}
    log.info("kernels on %s: %s", device, names)
    return Kernels(**{op: fn for op, (_name, fn) in chosen.items()}, names=names)


def fp8_backend_for(linear: str) -> str:
    """W8A8 linears follow the linear backend's persistent Triton grids too, else "auto"."""
    return linear if linear in BACKENDS["fp8_linear"] else "auto"


def moe_backend_for(linear: str) -> str:
    """The MoE expert GEMMs follow the linear backend where one of the same name exists (the
    persistent Triton grids), else "auto"."""
    return linear if linear in BACKENDS["moe_experts"] else "auto"


def fp8_prefill_in_place(kernels: Kernels) -> bool:
    """Whether forwards holding a prefill chunk read an FP8 KV cache in place on FlashMLA's FP8
    decode kernel (--fp8-prefill-attention flash-mla), rather than its keys dequantized for the
    bf16 sparse prefill kernel: DeepSeek-V4 follows V3.2's mla_prefill_fp8 choice."""
    return kernels.names.get("mla_prefill_fp8") == "flash-mla"
