"""transformers as the oracle on the SmolLM2 checkpoint: greedy ids and log-softmax."""

from __future__ import annotations

import torch

SERVED_NAME = "SmolLM2-135M-Instruct"
EOS = 2  # <|im_end|>


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """Greedy continuation, stopping after EOS like the engine does."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(prompt_ids):].tolist()


def hf_logprobs(model, prompt_ids: list[int], new_ids: list[int]) -> torch.Tensor:
    """log-softmax (float32) of the distribution each token of `new_ids` was drawn from."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + new_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
