"""The per-ISA table: kvmesh's defaults at every kernel level this CPU supports, side by side.

For each level (the ``kernel_isa`` setting forced: ``scalar``, ``avx2``, ``avx512``, ``avx512bf16``,
``amx``, up to the CPU's best, or ``--levels``), runs ``python -m bench.profile`` in a fresh
process with ``--dtype auto`` and the default weight format, so the level's own defaults apply
(``EngineConfig.torch_dtype``: float32 at ``scalar``, bfloat16 above; ``--weight-format auto``:
the published GGUF's blocks for the known models), and collects:

- decode tok/s at each ``--batch`` (``batch / step time``, median of plain steps) beside the
  roofline of the same run (bytes a decode step must read over the read bandwidth measured in
  that process: ``bench.profile``), as tok/s and as the share reached;
- cold prefill tok/s of one ``--prefill-tokens`` prompt;
- the share of a batch-1 decode step spent in ATen matmuls (``aten::mm``/``addmm``/``linear``
  ...): 0 when every projection runs kvmesh's kernels.

Usage::

    python -m bench.isa_table [--model smollm2-135m-instruct] [--levels scalar avx2] [--batch 1 8]
                              [--context 512] [--prefill-tokens 512] [--steps 8] [--out isa.json]

Levels run one after the other (never two at once); keep the table in a dated section of docs/results-history.md with
the CPU model it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from bench import command
from bench.markdown import add_output_args

ATEN_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")


def run_level(level: str, args) -> dict:
    """One ``bench.profile`` run at ``level``; its JSON plus the level asked for."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "profile.json")
        cmd = [sys.executable, "-m", "bench.profile", "--model", args.model, "--dtype", "auto",
               "--batch", *map(str, args.batch), "--context", str(args.context),
               "--prefill-tokens", str(args.prefill_tokens), "--steps", str(args.steps), "--top", "200",
               "--threads", str(args.threads), "--engine-arg", f"kernel_isa={level}", "--out", out]
        env = {**os.environ, "KVMESH_KERNEL_ISA": level}       # the kernels' level from their load on
        print(f"[isa_table] {level}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        res = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"bench.profile at {level} failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
        with open(out) as f:
            prof = json.load(f)
    prof["level"] = level
    return prof


def row(prof: dict) -> dict:
    bw = prof["bandwidth_bytes_per_s"]
    decode = []
    for d in prof["decode"]:
        tok_s = d["batch"] / (d["step_ms"] / 1e3)
        roof = d["batch"] / (d["bytes"] / bw)
        aten = sum(o["ms_per_step"] for o in d["ops"] if o["op"] in ATEN_MATMULS)
        decode.append({"batch": d["batch"], "tok_s": tok_s, "roofline_tok_s": roof, "share_of_roofline": tok_s / roof,
                       "aten_matmul_ms_per_step": aten, "step_ms": d["step_ms"]})
    p = prof["prefill"]
    return {"level": prof["level"], "kernel_isa": prof["kernel_isa"], "dtype": prof["torch_dtype"],
            "weight_format": prof["weight_format"], "bandwidth_gb_s": bw / 1e9, "decode": decode,
            "prefill_tokens": p["tokens"], "prefill_tok_s": p["tokens"] / (p["ttft_ms"] / 1e3)}


def markdown(rows: list[dict]) -> str:
    batches = [d["batch"] for d in rows[0]["decode"]]
    head = ["level", "kernels", "dtype", "weights", "read GB/s"]
    for b in batches:
        head += [f"decode B={b} tok/s", f"roofline B={b} tok/s (share)"]
    head += [f"prefill {rows[0]['prefill_tokens']} tok/s", "ATen matmul ms/step (B=1)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["level"], r["kernel_isa"], r["dtype"], r["weight_format"], f"{r['bandwidth_gb_s']:.1f}"]
        for d in r["decode"]:
            cells += [f"{d['tok_s']:.1f}", f"{d['roofline_tok_s']:.1f} ({d['share_of_roofline']:.0%})"]
        cells += [f"{r['prefill_tok_s']:.0f}", f"{r['decode'][0]['aten_matmul_ms_per_step']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = command.parser(__doc__, prog="python -m bench.isa_table")
    ap.add_argument("--levels", nargs="+", default=None, help="kernel levels (default: every one this CPU has)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    add_output_args(ap, table=False)
    args = ap.parse_args(argv)
    from bench.machine import cpu_model
    from kvmesh.core.engine_config import KERNEL_LEVELS, cpu_kernel_level
    best = cpu_kernel_level()
    levels = args.levels or list(KERNEL_LEVELS[: KERNEL_LEVELS.index(best) + 1])
    rows = [row(run_level(level, args)) for level in levels]
    res = {"cpu": cpu_model(), "model": args.model, "threads": args.threads, "context": args.context,
           "command": "python -m bench.isa_table " + " ".join(argv if argv is not None else sys.argv[1:]), "rows": rows}
    print(f"\n# CPU: {res['cpu']}; model {args.model}; context {args.context}; {args.threads} threads\n")
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
