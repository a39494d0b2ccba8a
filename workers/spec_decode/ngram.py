"""Prompt-lookup ("ngram") proposals for speculative decoding.

The proposer needs no second model: it looks for the most recent earlier occurrence of the
sequence's last ``n`` tokens in its own tokens (prompt + output) and proposes the tokens that
followed it, trying ``n`` from ``n_max`` down to ``n_min`` (Saxena 2023, "Prompt Lookup
Decoding", https://github.com/apoorvumang/prompt-lookup-decoding; vLLM's ``ngram`` method).
It pays off where the output copies spans of the input: summaries, extraction, code edits,
answers quoting a policy document.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` proposed next tokens for a sequence, [] when no ngram matches.

    Args:
        token_ids: the sequence so far (prompt + output), token ids.
        k: most tokens to propose.
        n_max, n_min: match lengths tried, longest first (``1 <= n_min <= n_max``).
    Returns:
        the tokens after the most recent earlier occurrence of the last ``n`` tokens, for the
        largest ``n`` with a match (at most ``k``; fewer when the match is near the end).

    Vectorised over positions (numpy): one pass of ``n`` comparisons over the sequence per
    match length (its cost: docs/spec_decode.md, "The two proposers").
    """
    L = len(token_ids)
    if k <= 0 or L < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = arr[L - n:]
        # candidate starts i in [0, L - n - 1]: an earlier occurrence arr[i:i+n] == tail
        m = arr[: L - n] == tail[0]
        for j in range(1, n):
            m &= arr[j: L - n + j] == tail[j]
        hits = np.flatnonzero(m)
        if hits.size:
            i = int(hits[-1]) + n          # the continuation of the most recent occurrence
            return arr[i: i + k].tolist()
    return []
