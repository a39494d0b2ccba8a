"""``kvmesh bench serve``: flags, the mesh it starts when given no server, the result file."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import bench.serve
from bench import command
from bench.markdown import add_output_args
from bench.serve.backends import BACKENDS
from bench.serve.load import run_benchmark
from bench.serve.metrics import RequestRecord, parse_goodput, report, summarize
from bench.serve.plots import plot_sweep, plot_ttft
from bench.serve.workload import DATASETS, load_requests, load_workload, save_workload
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import SchedulerConfig
from kvmesh.core.errors import EngineError
from kvmesh.core.flags import (add_engine_args, add_scheduler_args, given_flags, scheduler_rename,
                               settings_argv)


def _rate(v: str) -> float:
    try:
        r = float(v)
    except ValueError:
        r = -1.0
    if not r > 0:
        raise argparse.ArgumentTypeError(f"expected a rate > 0 in requests/s or inf, got {v!r}")
    return r


def _rates(v: str) -> list[float]:
    return [_rate(x) for x in v.split(",") if x.strip()]


def _percentiles(v: str) -> list[float]:
    try:
        ps = [float(x) for x in v.split(",") if x.strip()]
    except ValueError:
        ps = []
    if not ps or not all(0 < p < 100 for p in ps):
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles in (0, 100), got {v!r}")
    return ps


def add_parser(subparsers, help: str) -> argparse.ArgumentParser:
    """``kvmesh bench serve`` (:mod:`bench.command`)."""
    return command.add_parser(subparsers, "serve", help, bench.serve.__doc__.split("\n\n")[0], add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.serve``: the same as ``kvmesh bench serve``."""
    return command.main("kvmesh bench serve", bench.serve.__doc__.split("\n\n")[0], add_arguments, run, argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default="kvmesh",
                   help="kvmesh: the gRPC gateway; openai-chat: streaming /v1/chat/completions (vLLM, llama.cpp)")
    g.add_argument("--address", metavar="HOST:PORT", help="kvmesh gateway; default: start a mesh (`kvmesh serve` "
                                                          "subprocess) from the engine and scheduler flags")
    g.add_argument("--base-url", metavar="URL", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1; "
                                                     "default (openai-chat): start a mesh and use its --http-port")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="policydesk")
    g.add_argument("--workload", metavar="FILE", help="replay a JSONL workload file (instead of --dataset)")
    g.add_argument("--save-workload", metavar="FILE", help="write the requests as JSONL and exit (no server)")
    g.add_argument("--num-prompts", type=int, metavar="N",
                   help="arrivals (sessions for policydesk-chat); default: the whole data set once (random: 100)")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N", help="output tokens per request (128)")
    g.add_argument("--random-input-len", type=int, default=1024, metavar="N")
    g.add_argument("--random-output-len", type=int, default=128, metavar="N")
    g.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="lengths uniform in [len x (1-R), len x (1+R)] (0)")
    g.add_argument("--tokenizer", metavar="NAME|DIR", help="tokenizer of the random data set (default: --model, "
                                                           "else smollm2-135m-instruct)")
    g.add_argument("--seed", type=int, default=0, help="request order, arrival gaps, random prompts (0)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=_rate, default=float("inf"), metavar="R",
                   help="requests (sessions) per second; inf = all at once (inf)")
    g.add_argument("--burstiness", type=float, default=1.0, metavar="B",
                   help="gamma shape of the arrival gaps: 1 = Poisson, <1 burstier, >1 more regular (1)")
    g.add_argument("--max-concurrency", type=int, metavar="N", help="most requests in flight (no limit)")
    g.add_argument("--sweep-rates", type=_rates, metavar="R,R,...", help="run at each rate (e.g. 0.5,1,2,inf)")
    g.add_argument("--num-warmups", type=int, default=0, metavar="N", help="unrecorded requests sent first (0)")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (0)")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly max-tokens tokens")
    g.add_argument("--request-timeout", type=float, metavar="S",
                   help="kvmesh backend: each request's deadline, queueing included (default: the gateway's, 300 s)")
    g = p.add_argument_group("results")
    g.add_argument("--percentiles", type=_percentiles, default=[50.0, 90.0, 99.0], metavar="P,P,...",
                   help="reported percentiles (50,90,99)")
    g.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (ms)")
    add_output_args(g, table=False)    # config and summary (JSON)
    g.add_argument("--save-detailed", action="store_true", help="per-request records in the result file")
    g.add_argument("--save-texts", action="store_true", help="generated texts in the result file")
    g.add_argument("--plot-dir", metavar="DIR", help="write ttft.png (and sweep.png with --sweep-rates)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_scheduler_args(p, listen=None)
    add_engine_args(p)


def _mesh_argv(args: argparse.Namespace) -> list[str]:
    """``kvmesh serve`` arguments of the engine and scheduler flags given (free loopback ports)."""
    argv = ["serve", "--host", "127.0.0.1", "--port", "0", "--scheduler-port", "0", "--grace", "1"]
    if args.backend == "openai-chat":           # the mesh's own OpenAI-compatible HTTP API
        argv += ["--http-port", "0"]
    return (argv + settings_argv(args, EngineConfig)
            + settings_argv(args, SchedulerConfig, "scheduler_", rename=scheduler_rename(None)))


@contextlib.contextmanager
def _target(args: argparse.Namespace):
    """The address or base URL to benchmark; starts a mesh (``kvmesh serve``) when there is no
    --address (kvmesh) or --base-url (openai-chat: the mesh's own HTTP API, ``--http-port``)."""
    local = given_flags(args, EngineConfig, skip=("model",)) + given_flags(args, SchedulerConfig, "scheduler_")
    given = args.base_url if args.backend == "openai-chat" else args.address
    if given and local:
        raise EngineError(f"{', '.join(local)}: engine/scheduler settings start a mesh; not with "
                          f"{'--base-url' if args.backend == 'openai-chat' else '--address'}")
    if given:
        yield given
    else:
        from bench.served import served
        env = dict(os.environ, RAY_AUTH_MODE="disabled")
        print(f"kvmesh: starting a mesh: kvmesh {' '.join(_mesh_argv(args))}", file=sys.stderr, flush=True)
        if args.backend == "openai-chat":
            with served(_mesh_argv(args), env, "http") as address:
                yield f"http://{address}/v1"
        else:
            with served(_mesh_argv(args), env, "gateway") as address:
                yield address


def _record_json(r: RequestRecord, texts: bool) -> dict:
    d = dataclasses.asdict(r)
    d["tpot"] = r.tpot
    if not texts:
        del d["text"]
    return d


def run(args: argparse.Namespace) -> int:
    """``kvmesh bench serve``; returns the exit code (2 for bad arguments, 1 when the server fails)."""
    try:
        return _main(args)
    except EngineError as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, RuntimeError) as e:
        print(f"kvmesh: error: {e}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    slos = parse_goodput(args.goodput)
    if args.backend == "kvmesh" and args.base_url:
        raise EngineError("--base-url is for --backend openai-chat (kvmesh takes --address)")
    if args.workload:
        requests = load_workload(args.workload, args.num_prompts)
    else:
        requests = load_requests(args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                                 max_tokens=args.max_tokens,
                                 **({"random_input_len": args.random_input_len,
                                     "random_output_len": args.random_output_len,
                                     "random_range_ratio": args.random_range_ratio,
                                     "tokenizer": args.tokenizer or args.model} if args.dataset == "random" else {}))
    if args.save_workload:
        save_workload(args.save_workload, requests)
        print(f"kvmesh: wrote {len(requests)} requests to {args.save_workload}", file=sys.stderr)
        return 0
    rates = args.sweep_rates or [args.request_rate]
    # openai-chat: the name to send; none (the served model, from /v1/models) for a mesh started here
    model = (args.model or "") if args.backend == "openai-chat" and args.base_url else ""
    runs, rows = {}, []
    with _target(args) as target:
        for rate in rates:
            label = f"{rate:g} req/s"
            print(f"kvmesh: {args.backend} at {target}: {len(requests)} arrivals, rate {label}, burstiness "
                  f"{args.burstiness:g}, max concurrency {args.max_concurrency or '-'}", file=sys.stderr, flush=True)
            records = asyncio.run(run_benchmark(
                args.backend, target, requests, request_rate=rate, burstiness=args.burstiness,
                max_concurrency=args.max_concurrency, temperature=args.temperature, seed=args.seed,
                ignore_eos=args.ignore_eos, progress=not args.no_progress, model=model,
                num_warmups=args.num_warmups if rate == rates[0] else 0, request_timeout=args.request_timeout))
            summary = summarize(records, percentiles=args.percentiles, goodput_slos=slos)
            print(report(summary, args.percentiles, f"{args.backend}, {label}"), flush=True)
            for r in [r for r in records if not r.success][:3]:
                print(f"kvmesh: {r.id} failed: {r.error}", file=sys.stderr)
            runs[label] = records
            rows.append({"request_rate": rate, **summary})
    if args.plot_dir:
        Path(args.plot_dir).mkdir(parents=True, exist_ok=True)
        plot_ttft(runs, Path(args.plot_dir) / "ttft.png")
        if args.sweep_rates:
            plot_sweep(rows, Path(args.plot_dir) / "sweep.png")
    if args.out:
        config = {k: v for k, v in vars(args).items() if k != "func" and v is not None}
        config.update(target=target, num_arrivals=len(requests),
                      date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        out = {"config": config, **rows[-1], "runs": rows if args.sweep_rates else None}
        if args.save_detailed or args.save_texts:
            out["records"] = {label: [_record_json(r, args.save_texts) if args.save_detailed
                                      else {"id": r.id, "success": r.success, "text": r.text} for r in recs]
                              for label, recs in runs.items()}
        Path(args.out).write_text(json.dumps(_jsonable(out), indent=1, allow_nan=False))
    return 0 if any(row["completed"] for row in rows) else 1


def _jsonable(v):
    """Strict JSON: an infinite rate becomes the string "inf", paths strings."""
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)

