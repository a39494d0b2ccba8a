"""Peer runner: OpenVINO GenAI ``LLMPipeline`` on CPU (openvino-venv) on the PolicyDesk prompts.

The model is an OpenVINO IR exported by setup_openvino.sh from kvmesh's dense checkpoint
(``--model-dir``: ``$PEERS_HOME/openvino-models/NAME-FORMAT``, weights fp16, int8 or int4 as
exported; the weight format is read back from the IR and recorded in ``settings``). The pipeline
is built with a ``SchedulerConfig``, so LLMPipeline runs its continuous-batching backend (paged
attention): ``max_num_seqs`` = the batch size, prefix caching on, ``cache_size``
``--kv-cache-gb`` GB, ``max_num_batched_tokens`` ``--max-num-batched-tokens`` (prompts split
into chunks and fused with decode steps: ``dynamic_split_fuse``). The requests of a throughput
pass go to ``generate`` at most B at a time, as a padded ``TokenizedInputs`` (input_ids +
attention_mask; LLMPipeline turns each row, without its padding, into its own request and
schedules them all at once), so kvmesh's ``prompt_token_ids`` are fed as they are, never
re-tokenized; requests with different ``max_tokens`` go in calls per length, in turn.
``max_num_seqs`` alone does not hold a call to B requests: measured here (Xeon with AMX,
2026-12-05, SmolLM2 fp16 IR), 3 cold PolicyDesk prompts of 64 tokens in one call took 3.40 s with
``max_num_seqs`` 1 and 3.35 s with 8, against 5.53 s as three calls: the pipeline ran them
together either way, so a B = 1 pass of one call was in fact batched.
Greedy, ``ignore_eos``, exactly ``max_tokens`` new tokens each. Device properties:
``INFERENCE_NUM_THREADS`` = ``--threads``, ``INFERENCE_PRECISION_HINT`` = ``--precision-hint``
(bf16 by default, as the other rows; a CPU without AVX512_BF16 / AMX runs f32 whatever the hint:
settings record the precision the CPU plugin actually picks), ``KV_CACHE_PRECISION``
``--kv-cache-precision`` (default: the IR's own runtime option, else the plugin's default, u8 on
x86). Each batch size runs in a fresh child process (fresh pipeline, cold prefix cache, its own
peak RSS); the single-request run gets a fresh ``max_num_seqs=1`` pipeline of its own (there is
no prefix-cache reset), timed by a token streamer. The warm-up request (4 tokens) uses the first
64 prompt tokens reversed, so it leaves nothing in the prefix cache that a prompt can reuse.
Input/output formats: runner_common.py. Usage (from the repo root)::

    ~/.cache/kvmesh/peers/openvino-venv/bin/python bench/peers/run_openvino.py --model-dir DIR --prompts FILE \
        [--batch-sizes 1,8] [--decode-tokens 128] [--precision-hint bf16] [--threads 2] \
        [--kv-cache-precision u8] [--kv-cache-gb 3] [--max-num-batched-tokens 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import runner_common as rc

HINTS = {"bf16": "bf16", "f16": "f16", "f32": "f32", "auto": None}     # auto: leave the plugin's default


def device_properties(args) -> dict:
    props = {"INFERENCE_NUM_THREADS": args.threads}
    if HINTS[args.precision_hint]:
        props["INFERENCE_PRECISION_HINT"] = HINTS[args.precision_hint]
    if args.kv_cache_precision:
        props["KV_CACHE_PRECISION"] = args.kv_cache_precision
    return props


def model_info(model_dir: str) -> dict:
    """Weight format and runtime options, read from the IR's rt_info (openvino_model.xml)."""
    with open(os.path.join(model_dir, "openvino_model.xml"), encoding="utf-8") as fh:
        xml = fh.read()
    tag = lambda name, text=xml: (m.group(1) if (m := re.search(rf'<{name} value="([^"]*)"', text)) else None)
    info: dict = {}
    wc = re.search(r"<weight_compression>(.*?)</weight_compression>", xml, re.S)
    if wc:
        block = wc.group(1)
        fallback = re.search(r"'group_size_fallback_mode': '(\w+)'", block)
        info["weight_format"] = (tag("mode", block) or "?").split("_")[0]
        info["weight_compression"] = {k: tag(k, block) for k in ("mode", "group_size", "ratio", "all_layers",
                                                                  "backup_mode", "awq", "scale_estimation", "gptq")}
        info["weight_compression"]["group_size_fallback"] = fallback.group(1) if fallback else None
    else:
        info["weight_format"] = "fp16" if 'element_type="f16"' in xml else "fp32"
    opts = re.search(r"<runtime_options>(.*?)</runtime_options>", xml, re.S)
    info["ir_runtime_options"] = dict(re.findall(r'<(\w+) value="([^"]*)"', opts.group(1))) if opts else {}
    return info


def effective_precision(props: dict) -> str:
    """The inference precision the CPU plugin settles on for these properties (a one-MatMul model
    compiled with them: a bf16 / f16 hint the CPU cannot run falls back to f32)."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    p = ops.parameter([1, 64], np.float32)
    model = ov.Model([ops.matmul(p, ops.constant(np.ones((64, 64), np.float32)), False, False)], [p])
    cm = ov.Core().compile_model(model, "CPU", {k: v for k, v in props.items() if k != "KV_CACHE_PRECISION"})
    return type_name(cm.get_property("INFERENCE_PRECISION_HINT"))


def type_name(t) -> str:
    """An ov.Type property value as OpenVINO spells it: "f32", "bf16", "u8"."""
    return t.to_string() if hasattr(t, "to_string") else str(t)


def make_pipeline(args, max_num_seqs: int, rows: list[dict]):
    import openvino_genai as og

    sched = og.SchedulerConfig()
    sched.max_num_seqs = max_num_seqs
    sched.cache_size = args.kv_cache_gb
    sched.max_num_batched_tokens = args.max_num_batched_tokens
    sched.enable_prefix_caching = not args.no_prefix_caching
    sched.dynamic_split_fuse = True
    pipe = og.LLMPipeline(args.model_dir, "CPU", scheduler_config=sched, **device_properties(args))
    warm = list(reversed(rows[0]["prompt_token_ids"][:64]))   # shares no prefix block with a prompt
    generate(pipe, [warm], 4)
    return pipe


def greedy(pipe, n: int):
    cfg = pipe.get_generation_config()
    cfg.max_new_tokens, cfg.min_new_tokens, cfg.ignore_eos = n, 0, True
    cfg.do_sample, cfg.num_beams, cfg.repetition_penalty = False, 1, 1.0
    return cfg


def generate(pipe, prompts: list[list[int]], n: int, streamer=None) -> list[list[int]]:
    """One ``LLMPipeline.generate`` call: every prompt a request of its own (right-padded batch,
    attention mask 0 on the padding), greedy, exactly ``n`` new tokens each."""
    import numpy as np
    import openvino as ov
    import openvino_genai as og

    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, :len(p)], mask[i, :len(p)] = p, 1
    out = pipe.generate(og.TokenizedInputs(ov.Tensor(ids), ov.Tensor(mask)), greedy(pipe, n), streamer)
    tokens = [list(t) for t in out.tokens]
    assert len(tokens) == len(prompts) and all(len(t) == n for t in tokens), \
        f"wanted {len(prompts)} x {n} tokens, got {[len(t) for t in tokens]}"
    return tokens


def child(args) -> dict:
    """One pipeline with ``max_num_seqs = args.child_batch``: the throughput pass over every
    prompt, or (``--child-single``) the single-request run."""
    import openvino_genai as og

    rows = rc.load_prompts(args.prompts)
    rss = rc.PeakRss()
    t0 = time.perf_counter()
    pipe = make_pipeline(args, args.child_batch, rows)
    startup_s = time.perf_counter() - t0

    if args.child_single:
        class Stamps(og.StreamerBase):
            """Time of every generated token (write() gets one token, or several at once)."""

            def __init__(self):
                super().__init__()
                self.times = []

            def write(self, token):
                now = time.perf_counter()
                self.times += [now] * (len(token) if isinstance(token, (list, tuple)) else 1)
                return og.StreamingStatus.RUNNING

            def end(self):
                pass

        row, n = rows[0], args.decode_tokens
        stamps = Stamps()
        t0 = time.perf_counter()
        ids = generate(pipe, [row["prompt_token_ids"]], n, stamps)[0]
        assert len(stamps.times) == n, f"streamer saw {len(stamps.times)} tokens, wanted {n}"
        out = {"prompt_tokens": len(row["prompt_token_ids"]), "ttft_s": stamps.times[0] - t0, "decode_tokens": n,
               "decode_tok_s": (n - 1) / (stamps.times[-1] - stamps.times[0]), "token_ids": ids,
               "startup_s": startup_s}
        return {"single": out | {"peak_rss_bytes": rss.stop()}}

    groups: dict[int, list[dict]] = {}
    for r in rows:
        groups.setdefault(int(r["max_tokens"]), []).append(r)
    n_out = 0
    t0 = time.perf_counter()
    b = args.child_batch
    for n, group in groups.items():
        for i in range(0, len(group), b):       # at most B in flight: max_num_seqs does not cap a call
            n_out += sum(len(t) for t in generate(pipe, [r["prompt_token_ids"] for r in group[i:i + b]], n))
    wall = time.perf_counter() - t0
    assert n_out == sum(int(r["max_tokens"]) for r in rows), "every request must generate exactly max_tokens"
    row = rc.throughput_row(args.child_batch, rows, wall, n_out, policy="continuous", startup_s=startup_s)
    return {"throughput": row | {"peak_rss_bytes": rss.stop()}}


def main(argv=None) -> int:
    ap = rc.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="OpenVINO IR directory exported by setup_openvino.sh")
    ap.add_argument("--precision-hint", default="bf16", choices=sorted(HINTS),
                    help="INFERENCE_PRECISION_HINT (auto: the CPU plugin's default)")
    ap.add_argument("--kv-cache-precision", default="", choices=["", "u8", "u4", "f16", "bf16", "f32"],
                    help="KV_CACHE_PRECISION ('' = the IR's runtime option, else the plugin's default)")
    ap.add_argument("--kv-cache-gb", type=int, default=3, help="SchedulerConfig.cache_size (whole GB)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--child-batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-single", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_batch:
        rc.child_report(child(args))
        return 0

    rc.load_prompts(args.prompts)                 # fail here, not in a child, on a bad file
    info = model_info(args.model_dir)
    throughput, single = [], None
    runs = [(b, False) for b in rc.batch_sizes(args.batch_sizes)] + [(1, True)]
    for b, is_single in runs:
        what = "single request" if is_single else f"batch {b}"
        cmd = [sys.executable, __file__, "--model-dir", args.model_dir, "--prompts", args.prompts,
               "--decode-tokens", str(args.decode_tokens), "--threads", str(args.threads),
               "--precision-hint", args.precision_hint, "--kv-cache-precision", args.kv_cache_precision,
               "--kv-cache-gb", str(args.kv_cache_gb), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
               "--child-batch", str(b)]
        cmd += ["--no-prefix-caching"] if args.no_prefix_caching else []
        cmd += ["--child-single"] if is_single else []
        print(f"openvino: {what}: starting a pipeline", file=sys.stderr, flush=True)
        part = rc.run_child(cmd, f"openvino: {what}")
        if part is None:
            return 1
        if "throughput" in part:
            throughput.append(part["throughput"])
            print(f"openvino: batch {b}: {part['throughput']['output_tok_s']:.1f} output tok/s", file=sys.stderr, flush=True)
        single = part.get("single", single)

    import openvino as ov
    core = ov.Core()
    env = rc.environment("openvino-genai", "openvino", "openvino-tokenizers", "numpy")
    env["cpu"] = core.get_property("CPU", "FULL_DEVICE_NAME")
    env["cpu_capabilities"] = list(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
    kv = args.kv_cache_precision or info["ir_runtime_options"].get("KV_CACHE_PRECISION") \
        or type_name(core.get_property("CPU", "KV_CACHE_PRECISION"))
    rc.emit({"peer": "openvino", "env": env,
             "settings": {"model_dir": args.model_dir, **info, "precision_hint": args.precision_hint,
                          "inference_precision": effective_precision(device_properties(args)),
                          "kv_cache_precision": kv, "threads": args.threads, "kv_cache_gb": args.kv_cache_gb,
                          "max_num_batched_tokens": args.max_num_batched_tokens, "dynamic_split_fuse": True,
                          "enable_prefix_caching": not args.no_prefix_caching,
                          "batching": "continuous (LLMPipeline with a SchedulerConfig: paged attention), "
                                      "max_num_seqs = batch size, at most B requests of one max_tokens per "
                                      "generate() call (a padded TokenizedInputs)"},
             "throughput": throughput, "single": single}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
