"""transformers as the oracle of the engine-vs-transformers Ray tests: greedy continuations one
prompt at a time (no padding effects), and the output channel's counts that every such run
checks. The tiny checkpoints are tests/cpu/conftest.py's."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tests.cpu.conftest import hf_model

PAD = 0
TINY_EOS = 2  # tests/cpu/conftest.py's configs


def greedy_continuations(
    model: Any, prompts: Sequence[Sequence[int]], max_new: int, eos_token_id: int
) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time. The mask is given:
    generate would otherwise take a prompt's PAD tokens for padding."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p)])
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos_token_id,
                pad_token_id=PAD,
            )
            out.append(generated[0, len(p) :].tolist())
    return out


def tiny_reference(arch: str, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations by the random model of `arch` that write_tiny_checkpoint writes."""
    return greedy_continuations(hf_model(arch), prompts, max_new, TINY_EOS)


def check_output_counts(stats: dict[str, Any], skip: str, pp: int) -> None:
    """What every engine run checks of the output channel once its requests are done: `auto`
    never misses, `off` never skips, the channel's own count of sends is the plans' (PP > 1),
    and every KV block is back in the pool."""
    comm = stats["pp_output_comm"]
    if skip == "auto":
        assert comm["missed"] == 0
    if skip == "off":
        assert comm["skipped"] == 0
    if pp > 1:
        assert stats["channel_output_sends"] == comm["sent"]
    assert stats["kv_cache_usage"] == 0.0


# -- the GPU tests' bf16 checkpoint -------------------------------------------------------------
def write_bf16_llama(path: str, max_position_embeddings: int, arch: str = "llama") -> str:
    """The tiny random llama (or another tests/cpu/conftest.py arch) saved in bf16;
    max_position_embeddings (default RoPE) only bounds the prompt length."""
    model = hf_model(arch)
    model.config.max_position_embeddings = max_position_embeddings
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def bf16_reference(
    path: str, prompts: Sequence[Sequence[int]], max_new: int, device: str = "cuda"
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers on the bf16 checkpoint, one prompt at a time: each prompt's greedy tokens
    and the float logits of every step (for the near-tie checks)."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model = model.to(device).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([list(p)], device=device),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=TINY_EOS,
                pad_token_id=PAD,
                output_scores=True,
                return_dict_in_generate=True,
            )
            refs.append((out.sequences[0, len(p) :].tolist(), [s[0].float() for s in out.scores]))
    del model
    return refs


# -- the sparse-attention tie rule ---------------------------------------------------------------
def _stable_topk(
    self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> Any:
    """Tensor.topk by a stable sort: among equal values the lower index first (the rule of
    stages.kernels.indexer_select.top_k_positions, written here independently of it)."""
    if not largest:
        raise NotImplementedError("the indexers only ask for the largest")
    idx = torch.sort(self, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, idx), idx))


@contextlib.contextmanager
def stable_indexer_topk() -> Iterator[None]:
    """transformers' DeepSeek-V3.2 and V4 indexers select their keys with a stable sort while
    this is open: their `index_scores.topk` leaves the choice among tied scores (common: the
    ReLU zeros) to torch, which ppserve does not, so the oracle is made to keep ppserve's rule."""
    indexers = []
    for module, name in (
        ("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32Indexer"),
        ("transformers.models.deepseek_v4.modeling_deepseek_v4", "DeepseekV4Indexer"),
    ):
        try:
            indexers.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # no transformers, or one without that model
            continue
    originals = {cls: cls.forward for cls in indexers}

    def stable(forward: Any) -> Any:
        def forward_with_stable_topk(*args: Any, **kwargs: Any) -> Any:
            topk = torch.Tensor.topk
            torch.Tensor.topk = _stable_topk  # type: ignore[method-assign,assignment]
            try:
                return forward(*args, **kwargs)
            finally:
                torch.Tensor.topk = topk  # type: ignore[method-assign]

        return forward_with_stable_topk

    for cls, forward in originals.items():
        cls.forward = stable(forward)
    try:
        yield
    finally:
        for cls, forward in originals.items():
            cls.forward = forward
