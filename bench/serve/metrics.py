"""What the client saw of each request (:class:`RequestRecord`, timed by :class:`StreamTimer`)
and vLLM's aggregate metrics over a run (:func:`summarize`, :func:`report`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvmesh.core.errors import EngineError

SLO_METRICS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request. Times in seconds: ``ttft``, ``itl`` (gaps between
    token-carrying chunks), ``e2el`` from the request's send; ``start_time`` is the send time
    from the benchmark's start. Token counts are the server's usage (``cached_tokens``: prompt
    tokens served from the prefix cache, when the server says). ``turn`` is the turn index in a
    session (``id`` is then ``<session id>/<turn>``)."""

    id: str
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    success: bool = False
    error: str = ""
    text: str = ""
    cached_tokens: int = 0
    start_time: float = 0.0
    session_id: str = ""
    turn: int = 0
    finish_reason: str = ""

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output_tokens - 1) in seconds; None below two output tokens."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


class StreamTimer:
    """The client-side timeline of one streamed request: :meth:`chunk` for every received chunk
    that carries tokens, then :meth:`done` or :meth:`failed`. Times from ``time.perf_counter``
    unless given (tests feed synthetic timelines)."""

    def __init__(self, now: float | None = None):
        self.start = time.perf_counter() if now is None else now
        self.first: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []
        self.chunks = 0

    def chunk(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.chunks += 1

    def done(self, rec: RequestRecord, *, text: str, output_tokens: int, prompt_tokens: int = 0,
             cached_tokens: int = 0, finish_reason: str = "", now: float | None = None) -> RequestRecord:
        """Fill ``rec`` for a stream that ended normally (failed when no chunk carried a token)."""
        now = time.perf_counter() if now is None else now
        if self.first is None:
            return self.failed(rec, "the stream carried no output tokens", now=now)
        rec.ttft, rec.itl, rec.e2el = self.first - self.start, self.itl, now - self.start
        rec.text, rec.output_tokens, rec.prompt_tokens, rec.cached_tokens = text, output_tokens, prompt_tokens, \
            cached_tokens
        rec.finish_reason, rec.start_time, rec.success = finish_reason, self.start, True
        return rec

    def failed(self, rec: RequestRecord, error: str, now: float | None = None) -> RequestRecord:
        now = time.perf_counter() if now is None else now
        rec.success, rec.error, rec.start_time, rec.e2el = False, error, self.start, now - self.start
        return rec


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos = {}
    for item in items:
        name, sep, value = item.partition(":")
        try:
            v = float(value)
        except ValueError:
            v = -1.0
        if not sep or name not in SLO_METRICS or not v > 0:
            raise EngineError(f"goodput: expected NAME:MS with NAME in {', '.join(SLO_METRICS)} and MS > 0, "
                              f"got {item!r}")
        slos[name] = v
    return slos


def benchmark_duration(records: Sequence[RequestRecord]) -> float:
    """Seconds from the run's start to the end of its last request (``start_time + e2el``)."""
    return max((r.start_time + r.e2el for r in records), default=0.0)


def _pkey(p: float) -> str:
    return f"p{p:g}"


def summarize(records: Sequence[RequestRecord], duration: float | None = None, *,
              percentiles: Sequence[float] = (50, 90, 99), goodput_slos: dict | None = None) -> dict:
    """vLLM's aggregate metrics over the successful requests: ``mean_/median_/std_/p<P>_`` of
    ``ttft``, ``tpot``, ``itl``, ``e2el`` in ms (None when no request has the metric; TPOT only over
    requests with 2+ output tokens); ``request_throughput`` (completed/s),
    ``output_throughput`` and ``total_token_throughput`` (tokens/s), ``request_goodput``
    (completed/s meeting every SLO of ``goodput_slos``, ms by metric name ttft/tpot/e2el; None
    without SLOs), ``completed``, ``failed``, token totals, ``prefix_cache_hit_rate`` (cached /
    prompt tokens), ``duration`` (s; None = :func:`benchmark_duration`). Percentiles are numpy's
    (linear interpolation)."""
    if duration is None:
        duration = benchmark_duration(records)
    if not duration > 0:
        raise EngineError(f"duration must be > 0, got {duration}")
    slos = goodput_slos or {}
    for name, v in slos.items():
        if name not in SLO_METRICS or not v > 0:
            raise EngineError(f"goodput_slos: {name}={v}: names are {', '.join(SLO_METRICS)}, values ms > 0")
    ok = [r for r in records if r.success]
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2el": [r.e2el for r in ok]}
    n_in, n_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    n_cached = sum(r.cached_tokens for r in ok)
    out = {"duration": duration, "completed": len(ok), "failed": len(records) - len(ok),
           "total_input_tokens": n_in, "total_output_tokens": n_out, "total_cached_tokens": n_cached,
           "prefix_cache_hit_rate": n_cached / n_in if n_in else None,
           "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration, "request_goodput": None}
    if slos:
        def good(r: RequestRecord) -> bool:
            got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
            return all(got[name] * 1e3 <= slo for name, slo in slos.items())
        out["request_goodput"] = sum(map(good, ok)) / duration
    for name in METRICS:
        ms = np.asarray(values[name], dtype=np.float64) * 1e3
        have = ms.size > 0
        out[f"mean_{name}_ms"] = float(ms.mean()) if have else None
        out[f"median_{name}_ms"] = float(np.median(ms)) if have else None
        out[f"std_{name}_ms"] = float(ms.std()) if have else None
        for p in percentiles:
            out[f"{_pkey(p)}_{name}_ms"] = float(np.percentile(ms, p)) if have else None
    return out


def report(summary: dict, percentiles: Sequence[float], title: str = "Serving Benchmark Result") -> str:
    """vLLM-style text table of a :func:`summarize` result."""
    def row(label, v, fmt="{:.2f}"):
        return f"{label:<40}{'-' if v is None else fmt.format(v):>12}"

    lines = [f"{' ' + title + ' ':=^52}", row("Successful requests:", summary["completed"], "{}"),
             row("Failed requests:", summary["failed"], "{}"), row("Benchmark duration (s):", summary["duration"]),
             row("Total input tokens:", summary["total_input_tokens"], "{}"),
             row("Total generated tokens:", summary["total_output_tokens"], "{}"),
             row("Prefix cache hit rate:", summary["prefix_cache_hit_rate"], "{:.1%}"),
             row("Request throughput (req/s):", summary["request_throughput"])]
    if summary["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", summary["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", summary["output_throughput"]),
              row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    for name, heading in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                          ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{heading:-^52}")
        lines.append(row(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(row(f"Median {name.upper()} (ms):", summary[f"median_{name}_ms"]))
        lines += [row(f"P{p:g} {name.upper()} (ms):", summary[f"{_pkey(p)}_{name}_ms"]) for p in percentiles
                  if p != 50]
    lines.append("=" * 52)
    return "\n".join(lines)
