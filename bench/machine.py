"""The machine a benchmark ran on: the CPU model with the ISA flags our kernels choose by, and
the read bandwidth measured in the same run (the denominator of every roofline); and how the
kernel benchmarks time a call on it (:func:`time_call`)."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def cpu_model() -> str:
    """The CPU's model name, its family and model numbers (``family 25 model 17``: what tells
    the CPU classes of these hosts apart, whose model names say only ``AMD EPYC``) and its ISA
    flags that matter to our kernels."""
    name, flags, ids = platform.processor() or "unknown", set(), {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and name in ("unknown", "x86_64", ""):
                name = value.strip()
            elif key in ("cpu family", "model"):
                ids.setdefault(key, value.strip())
            elif key == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags]
    family = f"family {ids['cpu family']} model {ids['model']}; " if len(ids) == 2 else ""
    return f"{name} ({os.cpu_count()} cpus; {family}{', '.join(isa) or 'no avx2'})"


def time_call(fn, repeats: int, clock=time.perf_counter, stat=statistics.median) -> float:
    """Seconds one call of ``fn`` takes: ``stat`` of ``repeats`` calls timed by ``clock``, after
    one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        times.append(clock() - t)
    return stat(times)


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: median time of ``sum`` over a ``gib`` GiB float32 tensor."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    return x.numel() * 4 / time_call(x.sum, repeats)
