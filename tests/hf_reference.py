"""transformers as the oracle of the engine-vs-transformers Ray tests: greedy continuations one
prompt at a time (no padding effects), and the output channel's counts that every such run
checks. The tiny checkpoints are tests/cpu/conftest.py's."""

from __future__ import annotations

from collections.abc import Sequence
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
