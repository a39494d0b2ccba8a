"""Batched next-token sampler (plain PyTorch, device-agnostic; semantics follow vLLM v1).

One :class:`Sampler` call turns ``[B, V]`` logits into ``B`` token ids:

1. logprobs (if any request asked) from the *raw* logits: ``log_softmax`` before penalties
   and temperature; the top-n tokens plus the sampled one.
2. penalties: repetition (CTRL, Keskar et al. 2019, https://arxiv.org/abs/1909.05858) over
   prompt+output tokens, presence/frequency (OpenAI API,
   https://platform.openai.com/docs/advanced-usage/frequency-and-presence-penalties) over
   output tokens.
3. greedy rows (temperature 0): argmax of the penalised logits.
4. random rows: temperature, min-p (Nguyen et al. 2024, https://arxiv.org/abs/2407.01082),
   top-k, top-p (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751), softmax, then the
   exponential race ``argmax(p / q), q ~ Exp(1)``, which draws exactly from ``p``.

A seeded request owns a ``torch.Generator`` and its row's noise comes only from it, so its
tokens do not depend on what else is in the batch or where its row sits. Every filter leaves
a row that does not use it bit-identical, so batch-wide flags cannot change a row's result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.core.sampling import SamplingParams

# Like vLLM: temperatures below this are treated as greedy (dividing by them overflows).
SAMPLING_EPS = 1e-5


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``, for one seeded request."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _pad(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    padded = [r + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).view(len(rows), width)


@dataclass
class SamplingMetadata:
    """Per-batch tensors built once per step from the requests in the batch."""

    temperature: torch.Tensor            # [B] f32; greedy rows hold 1.0 (never divided by 0)
    greedy_mask: torch.Tensor            # [B] bool
    top_k: torch.Tensor                  # [B] i64, vocab_size where off
    top_p: torch.Tensor                  # [B] f32, 1.0 where off
    min_p: torch.Tensor                  # [B] f32, 0.0 where off
    repetition_penalty: torch.Tensor | None   # [B] f32 (None when no_penalties)
    presence_penalty: torch.Tensor | None     # [B] f32
    frequency_penalty: torch.Tensor | None    # [B] f32
    prompt_token_ids: torch.Tensor | None     # [B, Lp] i64 padded with vocab_size (None unless a repetition penalty)
    output_token_ids: torch.Tensor | None     # [B, Lo] i64 padded with vocab_size
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    num_logprobs: list[int | None]       # per row: SamplingParams.logprobs
    max_num_logprobs: int | None         # None if no request asked
    generators: dict[int, torch.Generator]    # row -> generator, random rows with a seed only
    vocab_size: int

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              vocab_size: int, device: torch.device) -> "SamplingMetadata":
        greedy = [p.temperature < SAMPLING_EPS for p in params]
        rand = [p for p, g in zip(params, greedy) if not g]  # flags only look at random rows
        f32 = dict(dtype=torch.float32, device=device)
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        no_penalties = not any(p.has_penalties for p in params)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], **f32),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], **f32),
            min_p=torch.tensor([p.min_p for p in params], **f32),
            repetition_penalty=None if no_penalties else torch.tensor([p.repetition_penalty for p in params], **f32),
            presence_penalty=None if no_penalties else torch.tensor([p.presence_penalty for p in params], **f32),
            frequency_penalty=None if no_penalties else torch.tensor([p.frequency_penalty for p in params], **f32),
            prompt_token_ids=_pad(prompt_token_ids, vocab_size, device) if use_rep else None,
            output_token_ids=None if no_penalties else _pad(output_token_ids, vocab_size, device),
            all_greedy=all(greedy), all_random=not any(greedy), no_penalties=no_penalties,
            no_top_k=all(p.top_k <= 0 or p.top_k >= vocab_size for p in rand),
            no_top_p=all(p.top_p >= 1.0 for p in rand),
            no_min_p=all(p.min_p <= 0.0 for p in rand),
            num_logprobs=[p.logprobs for p in params],
            max_num_logprobs=max(asked) if asked else None,
            generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
            vocab_size=vocab_size,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                    # [B] int64
    logprobs: list[dict[int, float]] | None    # per row: top-n + sampled token ({} if the row didn't ask)


def _bincount(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with ``vocab_size`` -> [B, V] counts (the padding column is dropped)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty (CTRL, Keskar et al. 2019): over prompt+output tokens, a logit is
    divided by the penalty when positive and multiplied by it otherwise. Presence/frequency
    (OpenAI API docs): ``logit -= presence * (count > 0) + frequency * count`` over output tokens.
    Out of place; a row with neutral penalties comes back unchanged."""
    V = logits.shape[-1]
    out_counts = _bincount(md.output_token_ids, V)
    if md.prompt_token_ids is not None:
        seen = (_bincount(md.prompt_token_ids, V) > 0) | (out_counts > 0)
        pen = torch.where(seen, md.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / pen, logits * pen)
    return (logits - md.frequency_penalty[:, None] * out_counts
            - md.presence_penalty[:, None] * (out_counts > 0))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p (Nguyen et al. 2024): drop tokens with ``prob < min_p * max_prob``, computed in
    log space (``logit < max_logit + log(min_p)``) so no softmax is needed; min_p=0 keeps all."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None,
                      p: torch.Tensor | None) -> torch.Tensor:
    """Top-k, then top-p (nucleus, Holtzman et al. 2019) over the top-k renormalised probs,
    in one descending sort. Top-k keeps exactly k tokens (ties broken by sort order); top-p
    keeps token i iff the mass of the tokens ranked above it is < p, i.e. the smallest set
    whose mass reaches p, which always includes the most likely token."""
    logits_sort, idx = logits.sort(dim=-1, descending=True)
    if k is not None:
        rank = torch.arange(logits.shape[-1], device=logits.device)
        logits_sort = logits_sort.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        mass_above = probs_sort.cumsum(dim=-1) - probs_sort
        # rows with p == 1 are skipped outright: rounding could otherwise drop tail tokens
        drop = (mass_above >= p[:, None]) & (p[:, None] < 1.0)
        logits_sort = logits_sort.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, logits_sort)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: ``argmax(p_i / q_i)`` with ``q_i ~ Exp(1)`` i.i.d. picks token i with
    probability p_i (as in vLLM/gpt-fast). Rows with a generator draw their noise from it;
    the rest share one batched draw from the default generator."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for i, g in generators.items():
        q[i].exponential_(generator=g)
    return probs.div(q.clamp_min_(1e-30)).argmax(dim=-1)


def processed_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row samples from: ``[N, V]`` logits (float32, penalties
    already applied) → temperature, min-p, top-k, top-p, softmax → ``[N, V]`` float32 probs.
    Rows of ``md`` are positions: speculative verification passes one row per verified
    position (:mod:`workers.spec_decode.rejection`). Greedy rows hold temperature 1 and come
    out as the untempered, filtered distribution (callers take their argmax instead)."""
    logits = logits / md.temperature[:, None]
    if not md.no_min_p:
        logits = apply_min_p(logits, md.min_p)
    if not (md.no_top_k and md.no_top_p):
        logits = apply_top_k_top_p(logits, None if md.no_top_k else md.top_k,
                                   None if md.no_top_p else md.top_p)
    return logits.softmax(dim=-1)


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None if md.max_num_logprobs is None else logits.log_softmax(dim=-1)
        if not md.no_penalties:
            logits = apply_penalties(logits, md)
        greedy = None if md.all_random else logits.argmax(dim=-1)
        if md.all_greedy:
            tokens = greedy  # hot path with no penalties: one argmax, nothing else
        else:
            tokens = random_sample(processed_probs(logits, md), md.generators)
            if greedy is not None:
                tokens = torch.where(md.greedy_mask, greedy, tokens)
        logprobs = None if raw_logprobs is None else self._gather_logprobs(raw_logprobs, tokens, md)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs)

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor,
                         md: SamplingMetadata) -> list[dict[int, float]]:
        """Top-n of the raw log-probabilities plus the sampled token, one host copy per step."""
        top_vals, top_ids = raw.topk(md.max_num_logprobs, dim=-1)
        sampled = raw.gather(-1, tokens[:, None]).squeeze(-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        sampled, token_list = sampled.tolist(), tokens.tolist()
        out: list[dict[int, float]] = []
        for row, n in enumerate(md.num_logprobs):
            if n is None:
                out.append({})
                continue
            d = dict(zip(top_ids[row][:n], top_vals[row][:n]))
            d[token_list[row]] = sampled[row]
            out.append(d)
        return out
