"""Verification of proposed tokens: greedy matching and exact rejection sampling.

A speculating row scores its last token and ``k`` proposals ``x_1..x_k`` in one forward pass,
which gives the target's distributions ``p_0..p_k`` (``p_j`` predicts the token after ``j``
proposals). :func:`verify` turns them into the row's new tokens:

* greedy rows: accept the longest prefix of proposals equal to the target's argmax, then
  emit the target's argmax at the first mismatch (or after the last proposal). The output is
  exactly plain greedy decoding's.
* random rows: speculative sampling (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192,
  Algorithm 1 and Appendix A.1; Chen et al. 2023, https://arxiv.org/abs/2302.01318,
  Algorithm 2). Proposal ``x_j`` drawn from the draft's ``q_j`` is accepted with probability
  ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection the row emits a token from
  ``norm(max(0, p_j - q_j))`` and stops; when all are accepted it emits a bonus token from
  ``p_k``. Each emitted token is then distributed exactly as ``p`` (the accepted mass
  ``min(p, q)`` plus the residual ``(1 - Σ min(p, q)) · norm(max(0, p - q)) = max(0, p - q)``
  add up to ``p``), so the output has the target's distribution whatever the proposals.
  A proposer without probabilities (prompt lookup) is a point mass ``q = δ(x)``: accept with
  probability ``p(x)``; on rejection sample from ``p`` with ``x`` removed (``max(0, p - δ(x))``
  renormalised).

``p`` and ``q`` are *processed* distributions (temperature, min-p, top-k, top-p:
:func:`workers.layers.sampler.processed_probs`). Randomness: a seeded row draws its uniforms
and then its sampling noise from its own generator, so its tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.layers.sampler import random_sample


@dataclass
class VerifyRow:
    """One speculating row: its ``k`` proposals, the draft's ``[k, V]`` float32 probabilities
    they were drawn from (None: point mass, as for prompt lookup or a greedy draft), whether
    the row is greedy, and its seeded generator (None: the default one)."""

    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None
    greedy: bool = True
    generator: torch.Generator | None = None


def verify(rows: list[VerifyRow], target_argmax: torch.Tensor,
           target_probs: torch.Tensor | None) -> list[list[int]]:
    """New tokens of each row: its accepted proposals, then one token of the target's.

    Args:
        rows: the speculating rows, in batch order.
        target_argmax: ``[N]`` int64, argmax of the target's logits at each scored position,
            ``N = Σ (k_i + 1)``; row i's positions are consecutive, in row order.
        target_probs: ``[N, V]`` float32 processed target distributions (needed when a row is
            not greedy, else may be None).
    Returns:
        per row, ``a + 1`` token ids where ``a`` is the number of accepted proposals.
    """
    argmax = target_argmax.tolist()
    offsets, off = [], 0
    for r in rows:
        offsets.append(off)
        off += len(r.draft_token_ids) + 1
    out: list[list[int] | None] = [None] * len(rows)
    rand = [i for i, r in enumerate(rows) if not r.greedy]
    for i, r in enumerate(rows):
        if r.greedy:
            xs, o = r.draft_token_ids, offsets[i]
            a = 0
            while a < len(xs) and argmax[o + a] == xs[a]:
                a += 1
            out[i] = xs[:a] + [argmax[o + a]]
    if not rand:
        return out
    assert target_probs is not None, "random rows need the target's probabilities"
    dev = target_probs.device
    ks = [len(rows[i].draft_token_ids) for i in rand]
    # u ~ U(0, 1) per proposal: seeded rows from their generators, the rest in one draw
    u_parts, gens = [], {}
    for b, i in enumerate(rand):
        g = rows[i].generator
        if g is not None:
            u_parts.append(torch.rand(ks[b], generator=g, device=g.device).to(dev))
            gens[b] = g
        else:
            u_parts.append(None)
    n_free = sum(k for k, part in zip(ks, u_parts) if part is None)
    free = torch.rand(n_free, device=dev) if n_free else None
    c = 0
    for b, part in enumerate(u_parts):
        if part is None:
            u_parts[b] = free[c: c + ks[b]]
            c += ks[b]
    u = torch.cat(u_parts) if u_parts else target_probs.new_empty(0)
    # p(x) and q(x) of every proposal; q = 1 for a point mass
    pos = torch.tensor([offsets[i] + j for i in rand for j in range(len(rows[i].draft_token_ids))],
                       dtype=torch.long, device=dev)
    xs = torch.tensor([x for i in rand for x in rows[i].draft_token_ids], dtype=torch.long, device=dev)
    px = target_probs[pos, xs]
    qs = [rows[i].draft_probs for i in rand]
    has_q = [q is not None for q in qs]
    qx = torch.ones_like(px)
    if any(has_q):
        mask = torch.tensor([h for h, k in zip(has_q, ks) for _ in range(k)], dtype=torch.bool, device=dev)
        qcat = torch.cat([q.to(dev, torch.float32) for q in qs if q is not None])      # [M, V]
        qx[mask] = qcat.gather(1, xs[mask][:, None]).squeeze(1)
    accept = (u * qx < px).tolist()
    # per row: a = accepted proposals (the first rejection ends the run)
    acc, c = [], 0
    for k in ks:
        a = 0
        while a < k and accept[c + a]:
            a += 1
        acc.append(a)
        c += k
    # the distribution of each row's last token: the residual max(0, p - q) at the first
    # rejection, or p at the bonus position when every proposal was accepted
    res = target_probs[torch.tensor([offsets[i] + a for i, a in zip(rand, acc)], dtype=torch.long, device=dev)]
    rej = [b for b, (a, k) in enumerate(zip(acc, ks)) if a < k]
    if rej:
        rej_t = torch.tensor(rej, dtype=torch.long, device=dev)
        x_rej = torch.tensor([rows[rand[b]].draft_token_ids[acc[b]] for b in rej], dtype=torch.long, device=dev)
        q_rej = torch.zeros(len(rej), res.shape[1], dtype=torch.float32, device=dev)
        q_rej.scatter_(1, x_rej[:, None], 1.0)                           # point mass δ(x)
        for j, b in enumerate(rej):
            if qs[b] is not None:
                q_rej[j] = qs[b][acc[b]].to(dev, torch.float32)
        p_rej = res[rej_t]
        r = (p_rej - q_rej).clamp_min_(0.0)
        empty = r.sum(dim=1) <= 0.0                                      # p == q (up to rounding)
        res[rej_t] = torch.where(empty[:, None], p_rej, r)
    # the exponential race draws from each (unnormalised) distribution exactly
    tokens = random_sample(res, gens).tolist()
    for b, i in enumerate(rand):
        out[i] = rows[i].draft_token_ids[: acc[b]] + [tokens[b]]
    return out
