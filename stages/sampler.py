"""Sampling on the last stage, one row per request that samples.

Each seeded row draws from its own generator, seeded from (seed, output index): a request with a
seed yields the same tokens whatever the PP size, chunk size or batch it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stages.protocol import PromptLogprobs, SamplingSpec

_MASK63 = (1 << 63) - 1


@dataclass
class RowToSample:
    spec: SamplingSpec
    output_index: int
    prompt_ids: tuple[int, ...]  # for repetition penalty
    output_ids: list[int]  # tokens this request sampled so far
    # Structured output: the allowed tokens as a packed bitmask (bit t % 8 of byte t // 8),
    # computed by the coordinator's grammar matcher for this very step.
    token_mask: bytes | None = None


@dataclass
class Sampled:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]


def _row_seed(seed: int, output_index: int) -> int:
    # A fixed mix (splitmix-like) so that neighbouring indices give unrelated streams.
    z = (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK63
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) & _MASK63
    return z ^ (z >> 29)


def _apply_penalties(logits: torch.Tensor, row: RowToSample) -> torch.Tensor:
    spec = row.spec
    if spec.repetition_penalty != 1.0:
        seen = list(row.prompt_ids) + row.output_ids
        if seen:
            idx = torch.tensor(sorted(set(seen)), device=logits.device)
            vals = logits[idx]
            vals = torch.where(
                vals > 0, vals / spec.repetition_penalty, vals * spec.repetition_penalty
            )
            logits = logits.index_copy(0, idx, vals)
    if (spec.presence_penalty or spec.frequency_penalty) and row.output_ids:
        counts = torch.bincount(
            torch.tensor(row.output_ids, device=logits.device), minlength=logits.shape[0]
        ).to(logits.dtype)
        logits = logits - spec.frequency_penalty * counts
        logits = logits - spec.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _shape(logits: torch.Tensor, row: RowToSample) -> torch.Tensor:
    """logit_bias, then allowed_token_ids and the grammar's mask (disallowed: -inf)."""
    spec = row.spec
    if spec.logit_bias:
        idx = torch.tensor([t for t, _ in spec.logit_bias], device=logits.device)
        bias = torch.tensor(
            [b for _, b in spec.logit_bias], dtype=logits.dtype, device=logits.device
        )
        logits = logits.index_add(0, idx, bias)
    if spec.allowed_token_ids:
        idx = torch.tensor(spec.allowed_token_ids, device=logits.device)
        logits = torch.full_like(logits, float("-inf")).index_copy(0, idx, logits[idx])
    banned = [
        seq[-1]
        for seq in spec.bad_words
        if len(seq) == 1 or tuple(row.output_ids[-(len(seq) - 1) :]) == seq[:-1]
    ]
    if banned:
        logits = logits.index_fill(0, torch.tensor(banned, device=logits.device), float("-inf"))
    if row.token_mask is not None:
        logits = logits.masked_fill(
            ~unpack_mask(row.token_mask, logits.shape[0], logits.device), float("-inf")
        )
    return logits


def unpack_mask(mask: bytes, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A packed token bitmask as a bool vector of `vocab_size` (tokens past the mask: False)."""
    packed = torch.frombuffer(bytearray(mask), dtype=torch.uint8)
    if device.type == "cuda":  # pinned: the copy must not wait for the stream
        packed = packed.pin_memory().to(device, non_blocking=True)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1).bool()
    if bits.shape[0] >= vocab_size:
        return bits[:vocab_size]
    return torch.cat([bits, bits.new_zeros(vocab_size - bits.shape[0])])


def _filter(probs: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """top-k, then top-p, then min-p, on a probability vector (renormalised by the caller)."""
    if spec.top_k and spec.top_k > 0 and spec.top_k < probs.shape[0]:
        kth = torch.topk(probs, spec.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if spec.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0) / sorted_p.sum()
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cum - sorted_p / sorted_p.sum()) >= spec.top_p
        sorted_p = torch.where(drop, torch.zeros_like(sorted_p), sorted_p)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    if spec.min_p > 0.0:
        probs = torch.where(probs >= spec.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs


# A scored prompt stretch, on the device: logprobs [m], ranks [m], top values [m, k] and top
# ids [m, k] (None when k == 0).
TokenScores = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
# (req_id, first position, *TokenScores)
PromptScores = tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


@dataclass
class Picked:
    """Tokens chosen on the device, not yet read by the host (reading waits for the GPU)."""

    token_ids: torch.Tensor  # [R] long
    rows: list[RowToSample]
    logprobs: torch.Tensor | None  # [R, V] log-softmax of the raw logits, when a row asks
    # CUDA: the ids copied to pinned host memory as soon as they are chosen, and the event that
    # marks the copy done. Reading them waits for this step only, not for work queued after it.
    host_ids: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    # Prompt logprobs on the device: (req_id, first position, logprobs [m], ranks [m],
    # top values [m, k] or None, top ids [m, k] or None)
    prompt: list[PromptScores] = field(default_factory=list)

    def prompt_logprobs(self) -> tuple[PromptLogprobs, ...]:
        """The prompt logprobs as the StepResult carries them (read from the device)."""
        return tuple(
            PromptLogprobs(
                req_id,
                start,
                tuple(lp.tolist()),
                tuple(ranks.tolist()),
                ()
                if top_v is None or top_i is None
                else tuple(tuple(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())),
            )
            for req_id, start, lp, ranks, top_v, top_i in self.prompt
        )

    def copy_to_host(self) -> None:
        if self.token_ids.device.type != "cuda":
            return
        self.host_ids = torch.empty(self.token_ids.shape, dtype=torch.long, pin_memory=True)
        self.host_ids.copy_(self.token_ids, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def ids(self) -> list[int]:
        if self.copied is None or self.host_ids is None:
            return self.token_ids.tolist()
        self.copied.synchronize()
        return self.host_ids.tolist()


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, k: int) -> TokenScores:
    """Logprobs of `targets` [m] under `logits` [m, V] (the raw model's), their ranks, and the
    top k (values, ids) when k > 0; all on the device."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen.unsqueeze(1)).sum(dim=1) + 1
    top = torch.topk(lp, k, dim=-1) if k > 0 else None
    return chosen, ranks, top.values if top else None, top.indices if top else None


def _plain_greedy(row: RowToSample) -> bool:
    spec = row.spec
    return (
        spec.greedy
        and not spec.needs_history
        and not spec.shapes_logits
        and (row.token_mask is None)
        and not (spec.min_tokens_banned and row.output_index < spec.min_tokens)
    )


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self._unseeded = torch.Generator(device=device)
        self._unseeded.manual_seed(seed ^ 0x5EED)

    def pick(self, logits: torch.Tensor, rows: list[RowToSample]) -> Picked:
        """Choose every row's token on the device, without waiting for it."""
        need_logprobs = any(r.spec.logprobs is not None for r in rows)
        # logprobs of the model's own output, only when asked: a full-vocabulary pass per row
        raw_logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None
        argmax = torch.argmax(logits, dim=-1)  # one kernel serves every plain greedy row
        if all(_plain_greedy(r) for r in rows):
            return Picked(argmax, rows, raw_logprobs)
        chosen = []
        for i, row in enumerate(rows):
            spec = row.spec
            if _plain_greedy(row):
                chosen.append(argmax[i])
                continue
            lg = _shape(_apply_penalties(logits[i], row), row)
            if spec.min_tokens_banned and row.output_index < spec.min_tokens:
                banned = torch.tensor(spec.min_tokens_banned, device=lg.device)
                lg = lg.index_fill(0, banned, float("-inf"))
            if spec.greedy:
                chosen.append(torch.argmax(lg))
                continue
            probs = _filter(torch.softmax(lg / spec.temperature, dim=-1), spec)
            if spec.seed is not None:
                gen = torch.Generator(device=lg.device)
                gen.manual_seed(_row_seed(spec.seed, row.output_index))
            else:
                gen = self._unseeded
            # Exponential race (= sampling from probs) with this row's generator only.
            q = torch.empty_like(probs).exponential_(1.0, generator=gen)
            chosen.append(torch.argmax(probs / q))
        return Picked(torch.stack(chosen), rows, raw_logprobs)

    @staticmethod
    def collect(picked: Picked) -> list[Sampled]:
        """The host's copy of the chosen tokens (and logprobs): waits for the device."""
        out: list[Sampled] = []
        ids = picked.ids()
        for i, (row, tok) in enumerate(zip(picked.rows, ids)):
            k = row.spec.logprobs
            if k is None:
                out.append(Sampled(tok, None, ()))
                continue
            if picked.logprobs is None:
                raise ValueError("a row asks for logprobs but the pick computed none")
            lp = picked.logprobs[i]
            top: tuple[tuple[int, float], ...] = ()
            if k > 0:
                vals, idx = torch.topk(lp, k)
                top = tuple(zip(idx.tolist(), vals.tolist()))
            out.append(Sampled(tok, float(lp[tok]), top))
        return out
