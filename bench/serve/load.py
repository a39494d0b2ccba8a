"""The load generator: arrival times (Poisson / gamma) and the run that sends a workload to a
backend at them, sessions turn after turn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Sequence

import numpy as np

from bench.serve.backends import SendFn, open_backend
from bench.serve.metrics import RequestRecord
from bench.serve.workload import BenchRequest
from kvmesh.core.errors import EngineError


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0,
                  rng: np.random.Generator | None = None) -> np.ndarray:
    """Send times ``[n]`` (float64 seconds from the start) of ``n`` arrivals: the first at 0, then
    gaps drawn from Gamma(shape=burstiness, scale=1/(request_rate x burstiness)) (mean
    1/request_rate; burstiness 1 = exponential gaps, a Poisson process; < 1 burstier, > 1 more
    regular), as vLLM's benchmark_serving. ``request_rate`` inf: all at 0."""
    if not request_rate > 0:
        raise EngineError(f"request_rate must be > 0 (inf = all at once), got {request_rate}")
    if not burstiness > 0:
        raise EngineError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate) or n == 0:
        return np.zeros(n)
    rng = rng if rng is not None else np.random.default_rng(0)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def run_benchmark(backend: str | SendFn, target: str, requests: Sequence[BenchRequest], *,
                        request_rate: float = float("inf"), burstiness: float = 1.0,
                        max_concurrency: int | None = None, temperature: float = 0.0, seed: int = 0,
                        ignore_eos: bool = False, progress: bool = True, model: str = "",
                        num_warmups: int = 0, request_timeout: float | None = None) -> list[RequestRecord]:
    """Send ``requests`` to ``backend`` (``kvmesh`` at gRPC address ``target``, ``openai-chat`` at
    base URL ``target``, or a ``send`` callable) at :func:`arrival_times` (seeded with ``seed``),
    at most ``max_concurrency`` in flight. A session's turns go one after the other, each after
    the previous answer completed, with that answer in its history; if a turn fails, the rest
    are recorded as failed, not sent. ``num_warmups`` requests (the first ones, one at a time)
    go first and are not recorded. Sampling: ``temperature`` (0 = greedy; above 0 each request
    is seeded with ``seed``), ``ignore_eos``. ``request_timeout``: each kvmesh request's deadline
    in seconds, queueing included (None = the gateway's default, 300 s; at most its max_timeout).
    Returns one record per request (per turn), in arrival order, ``start_time`` from the start
    of the run."""
    from tqdm.auto import tqdm

    if max_concurrency is not None and max_concurrency < 1:
        raise EngineError(f"max_concurrency must be >= 1, got {max_concurrency}")
    times = arrival_times(len(requests), request_rate, burstiness, np.random.default_rng(seed))
    sampling = {"temperature": temperature, "ignore_eos": ignore_eos, "seed": seed if temperature > 0 else None,
                "timeout": request_timeout}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with open_backend(backend, target, model) as send:
        for req in list(requests)[:num_warmups]:
            first = _first_request(req)
            rec = await send(first, sampling)
            if not rec.success:
                raise ConnectionError(f"warm-up request {first.id} failed: {rec.error}")
        pbar = tqdm(total=sum(r.num_requests for r in requests), disable=not progress, unit="req",
                    desc="bench serve", file=sys.stderr)

        async def one(req: BenchRequest) -> RequestRecord:
            async with sem:
                rec = await send(req, sampling)
            pbar.update(1)
            return rec

        async def arrival(req: BenchRequest) -> list[RequestRecord]:
            if not req.turns:
                return [await one(req)]
            history, records = list(req.messages or []), []
            session = req.session_id or req.id
            for k, user in enumerate(req.turns):
                history.append({"role": "user", "content": user})
                rec = await one(dataclasses.replace(req, id=f"{req.id}/{k}", messages=list(history), turns=None,
                                                    session_id=session))
                rec.turn = k
                records.append(rec)
                if not rec.success:
                    for j in range(k + 1, len(req.turns)):
                        records.append(RequestRecord(id=f"{req.id}/{j}", session_id=session, turn=j,
                                                     error=f"not sent: turn {k} failed",
                                                     start_time=rec.start_time + rec.e2el))
                        pbar.update(1)
                    break
                history.append({"role": "assistant", "content": rec.text})
            return records

        t0 = time.perf_counter()
        tasks = []
        for req, at in zip(requests, times):
            if (delay := t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(arrival(req)))
        try:
            done = await asyncio.gather(*tasks)
        finally:
            pbar.close()
    records = [r for rs in done for r in rs]
    for r in records:
        r.start_time -= t0
    return records


def _first_request(req: BenchRequest) -> BenchRequest:
    if not req.turns:
        return req
    return dataclasses.replace(req, messages=[*(req.messages or []), {"role": "user", "content": req.turns[0]}],
                               turns=None)
