"""Incremental stop-string matching: an Aho-Corasick automaton over a request's stop strings.

Text arrives a few characters at a time (one decode step's delta). :class:`StopMatcher` reads
each character once, so a step costs O(new characters) amortised, whatever the number and
length of the stop strings; building it costs O(total characters of the stop strings). Its
state also says how many trailing characters could still be the start of a stop string (the
text a streaming server must hold back), which a naive matcher recomputes over every stop
string at every step.

A match is the stop string that is complete first in the text (the earliest end); of the stop
strings ending at that character, the longest (the earliest start). The answer does not depend
on how the text was split into pieces.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopMatcher:
    """Feed text with :meth:`feed`; ``held`` is the length of the longest suffix of the text fed
    so far that is a prefix of a stop string (0 after a reset or when nothing could start one).

    Args:
        stops: the stop strings; empty strings and repeats are ignored.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        goto: list[dict[str, int]] = [{}]   # node -> {char: child}; node 0 = the root (empty prefix)
        depth = [0]                          # node -> length of its prefix
        ends = [-1]                          # node -> index of the stop string it completes, or -1
        for i, s in enumerate(self.stops):
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = goto[node][ch] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    ends.append(-1)
                node = nxt
            ends[node] = i
        # failure links (longest proper suffix that is also a node) and, per node, the longest
        # stop string that is a suffix of its prefix (its own, else its failure node's)
        fail = [0] * len(goto)
        match = list(ends)
        queue = deque(goto[0].values())
        while queue:
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f][ch] if node and ch in goto[f] else 0
                if match[child] < 0:
                    match[child] = match[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._depth, self._match = goto, fail, depth, match
        self._state = 0

    @property
    def held(self) -> int:
        """Characters at the end of the text fed so far that may begin a stop string."""
        return self._depth[self._state]

    def feed(self, text: str, *, report: bool = True) -> tuple[int, str] | None:
        """Read ``text``; return ``(end, stop)`` for the first stop string completed in it
        (``text[:end]`` ends with the part of ``stop`` that is in ``text``), else None. After a
        match the matcher should not be fed again. With ``report=False`` no stop string may end
        in ``text`` (None; the state and ``held`` still advance, so a stop string may begin in
        it and end in a later piece): the text of the first ``min_tokens`` output tokens."""
        goto, fail, match = self._goto, self._fail, self._match
        s = self._state
        for i, ch in enumerate(text):
            while s and ch not in goto[s]:
                s = fail[s]
            s = goto[s].get(ch, 0)
            if report and match[s] >= 0:
                self._state = s
                return i + 1, self.stops[match[s]]
        self._state = s
        return None
