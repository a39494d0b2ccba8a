"""Memory and time of loading a model's weights, each load in a fresh process.

    python -m bench.load_memory --model NAME_OR_DIR [--dtype bfloat16] [--runs 2]
                                [--weight-format none|int8|int4|fp8|w8a8-int8]
                                [--code DIR] [--max-positions 8192] [--out OUT]

For every run a new Python process imports kvmesh's loader (from ``--code``, default this
checkout: pass another checkout to measure its loader on the same machine), resolves the model
(``kvmesh.hub.pull.resolve_model`` without pulling; ``$KVMESH_HOME`` as usual), and records
the following. With a quantized ``--weight-format`` a first process builds the quantized
checkpoint cache (``ensure_quantized``, int4 group 128, calibration on, default data) unmeasured,
so that the runs measure loading it.

- ``baseline_rss``: VmRSS right before :func:`workers.loader.load_model` starts (interpreter,
  torch, kvmesh imported), bytes;
- ``peak_rss``: VmHWM after the load, bytes; the high-water mark is reset to the current RSS
  just before loading (``5`` written to ``/proc/self/clear_refs``) so that import-time peaks do
  not count (``hwm_reset`` false when the kernel refused; then VmHWM covers the whole process);
- ``weight_bytes``: :func:`workers.loader.weight_bytes` of the loaded model (served weights);
- ``ratio``: ``(peak_rss - baseline_rss) / weight_bytes``;
- ``rss_after``: VmRSS after the load, bytes; ``load_s``: wall time of ``load_model``;
- ``disk_bytes``: size of the checkpoint's ``*.safetensors`` files; ``file_dtypes``: count of
  its tensors per stored dtype; ``code``: the ``workers`` package the process imported.

The parent prints one line per run and a Markdown table row (MB = 10^6 bytes). Linux only
(``/proc/self/status``). torch runs on one intra-op thread (``--threads``), as a shared 2-core
machine wants.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import command
from bench.markdown import add_output_args

_REPO = Path(__file__).resolve().parents[1]


def _status_bytes(field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of /proc/self/status in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). Returns False when not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_once(model: str, dtype: str, device: str, max_positions: int, threads: int,
                 weight_format: str = "none") -> dict:
    """Load ``model`` once in this process and return the measurements (module docstring)."""
    import gc

    import torch

    import workers
    from workers.checkpoint import safetensors_files
    from workers.loader import load_model, weight_bytes
    from kvmesh.hub.pull import ensure_dense, resolve_model

    torch.set_num_threads(threads)
    model_dir = ensure_dense(resolve_model(model, pull_if_missing=False))   # a one-time conversion, not measured
    files = safetensors_files(Path(model_dir))
    from safetensors import safe_open
    dtypes: dict[str, int] = {}
    for f in files:                     # header only; closed before measuring
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                dt = sf.get_slice(k).get_dtype()
                dtypes[dt] = dtypes.get(dt, 0) + 1
    gc.collect()
    baseline = _status_bytes("VmRSS")
    reset = _reset_hwm()
    t0 = time.perf_counter()
    m = load_model(model_dir, dtype=getattr(torch, dtype), device=device, max_positions=max_positions,
                   weight_format=weight_format)
    load_s = time.perf_counter() - t0
    peak = _status_bytes("VmHWM")
    wb = weight_bytes(m)
    return {"model": str(model_dir), "dtype": dtype, "device": device, "weight_format": weight_format,
            "code": workers.__file__,
            "baseline_rss": baseline, "peak_rss": peak, "hwm_reset": reset, "rss_after": _status_bytes("VmRSS"),
            "weight_bytes": wb, "ratio": (peak - baseline) / wb, "load_s": round(load_s, 2),
            "disk_bytes": sum(f.stat().st_size for f in files), "file_dtypes": dtypes}


def run_child(model: str, dtype: str, *, code: Path = _REPO, device: str = "cpu", max_positions: int = 8192,
              threads: int = 1, weight_format: str = "none", prepare: bool = False, timeout: float = 3600) -> dict:
    """Run :func:`measure_once` in a fresh interpreter that imports kvmesh from ``code``
    (``prepare``: only build the quantized checkpoint cache; returns ``{}``).
    Raises RuntimeError with the child's stderr when it fails."""
    env = dict(os.environ, PYTHONPATH=str(code))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", model, "--dtype", dtype,
           "--device", device, "--max-positions", str(max_positions), "--threads", str(threads),
           "--weight-format", weight_format] + (["--prepare"] if prepare else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"load of {model} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return command.child_answer(proc.stdout) if not prepare else {}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="known model name or checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=2, help="fresh processes (the first may read from disk)")
    ap.add_argument("--code", type=Path, default=_REPO, help="kvmesh checkout whose loader is measured")
    ap.add_argument("--max-positions", type=int, default=8192, help="RoPE table size (tokens)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_output_args(ap, table=False)
    ap.add_argument("--weight-format", default="none", help="none or a quantized format (cache built first)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        # run as a script: bench/ itself is sys.path[0]; its modules must not shadow others
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
        if a.prepare:
            from workers.quant.store import ensure_quantized
            from kvmesh.hub.pull import resolve_model
            ensure_quantized(resolve_model(a.model, pull_if_missing=False), a.weight_format)
            return 0
        print(json.dumps(measure_once(a.model, a.dtype, a.device, a.max_positions, a.threads, a.weight_format)))
        return 0
    if a.weight_format != "none":
        run_child(a.model, a.dtype, code=a.code.resolve(), weight_format=a.weight_format, prepare=True)
    runs = []
    for i in range(a.runs):
        r = run_child(a.model, a.dtype, code=a.code.resolve(), device=a.device,
                      max_positions=a.max_positions, threads=a.threads, weight_format=a.weight_format)
        runs.append(r)
        print(f"run {i + 1}: baseline {_mb(r['baseline_rss'])} MB, peak {_mb(r['peak_rss'])} MB, "
              f"weights {_mb(r['weight_bytes'])} MB, ratio {r['ratio']:.3f}, load {r['load_s']} s "
              f"(code {r['code']}, hwm reset {r['hwm_reset']})", flush=True)
    last = runs[-1]
    print("| model | dtype | code | weights MB | disk MB | file dtypes | baseline RSS MB | peak RSS MB "
          "| (peak-baseline)/weights | load s |")
    wf = "" if a.weight_format == "none" else f" {a.weight_format}"
    print(f"| {Path(last['model']).name} | {a.dtype}{wf} | {a.code.resolve()} | {_mb(last['weight_bytes'])} "
          f"| {_mb(last['disk_bytes'])} | {', '.join(f'{k}:{v}' for k, v in sorted(last['file_dtypes'].items()))} "
          f"| {_mb(last['baseline_rss'])} | {_mb(max(r['peak_rss'] for r in runs))} "
          f"| {max(r['ratio'] for r in runs):.3f} | {statistics.median(r['load_s'] for r in runs):.1f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
