"""Peer runner: ONNX Runtime GenAI (``onnxruntime-genai``, ort-venv) on the PolicyDesk prompts.

The model is an ONNX model built by setup_ort.sh from kvmesh's dense checkpoint with ONNX Runtime
GenAI's model builder (``--model-dir``: ``$PEERS_HOME/ort-models/NAME-PRECISION``, fp32 or int4).
genai_config.json does not name the precision, so it is read from the graph genai_config names
(``model.onnx``: ``MatMulNBits`` bits, block size and accuracy level, else the float type of the
KV cache inputs; ``io_dtype``: that float type) and recorded in ``settings`` with the execution
provider (genai_config's ``provider_options``; none listed = ONNX Runtime's CPU execution
provider). An ``og.Generator`` is one static batch (every row prefills at once and decodes in
lock-step), so the throughput pass runs static batches of ``B`` requests like run_hf.py:
kvmesh's ``prompt_token_ids``, never re-tokenized, appended as one right-padded ``[B, width]``
int32 array (pad = genai_config's ``pad_token_id``; ORT GenAI masks the trailing pads and takes
each row's logits at its last real token). Greedy (``do_sample=False``, ``top_k=1``); every
request generates exactly ``max_tokens``: ``max_length`` = width + max_tokens ends it, and
``min_length`` = ``max_length`` holds EOS back (its logits are masked until then, as
transformers' ``min_new_tokens``). ``max_length`` also sizes the KV cache, which the builder's
CPU models preallocate (``past_present_share_buffer``); the builder's default LM head computes
logits for every prompt position (``[B, width, vocab]`` fp32 at prefill, in the peak RSS).
``--threads`` sets the decoder session's ``intra_op_num_threads`` (``inter_op_num_threads`` 1)
through ``Config.overlay``. One model (one ONNX Runtime session) serves every batch size; there
is no prefix cache. The single-request run: TTFT = generator creation + prefill
(``append_tokens``) + the first ``generate_next_token``; decode tok/s after the first token;
``startup_s`` = model load + a 4-token warm-up request (every row carries the same
``peak_rss_bytes``: the one process over all runs). Input/output formats: runner_common.py.
Usage (from the repo root)::

    ~/.cache/kvmesh/peers/ort-venv/bin/python bench/peers/run_ort.py --model-dir DIR --prompts FILE \
        [--batch-sizes 1,8] [--decode-tokens 128] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import json
import os
import sys
import time

import runner_common as rc


def model_info(model_dir: str) -> dict:
    """What genai_config.json says (graph file, execution provider, pad / EOS ids, KV cache) and
    the precision read from that graph with the ``onnx`` package (in ort-venv for the model
    builder; the weights are external data, not loaded)."""
    import onnx

    with open(os.path.join(model_dir, "genai_config.json"), encoding="utf-8") as fh:
        cfg = json.load(fh)
    dec = cfg["model"]["decoder"]
    providers = [name for opt in dec.get("session_options", {}).get("provider_options", []) for name in opt]
    graph = onnx.load(os.path.join(model_dir, dec["filename"]), load_external_data=False).graph
    node = next((n for n in graph.node if n.op_type == "MatMulNBits"), None)
    quant = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} if node is not None else None
    elem = {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.output)}
    past = dec["inputs"].get("past_key_names", "%d") % 0                     # the KV cache's type, else the logits'
    io = elem.get(past) or elem.get(dec["outputs"]["logits"])
    io_dtype = {onnx.TensorProto.FLOAT: "fp32", onnx.TensorProto.FLOAT16: "fp16",
                onnx.TensorProto.BFLOAT16: "bf16"}.get(io, str(io))
    precision = f"int{quant.get('bits', 4)}" if quant else io_dtype
    return {"precision": precision, "io_dtype": io_dtype,
            "matmul_nbits": ({k: quant.get(k) for k in ("bits", "block_size", "accuracy_level")} if quant else None),
            "execution_provider": providers[0] if providers else "cpu",
            "pad_token_id": cfg["model"]["pad_token_id"], "eos_token_id": cfg["model"]["eos_token_id"],
            "past_present_share_buffer": cfg["search"].get("past_present_share_buffer")}


def main(argv=None) -> int:
    ap = rc.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="ONNX Runtime GenAI model directory built by setup_ort.sh")
    args = ap.parse_args(argv)

    import numpy as np
    import onnxruntime_genai as og

    rows = rc.load_prompts(args.prompts)
    info = model_info(args.model_dir)
    pad = info["pad_token_id"]
    rss = rc.PeakRss()
    t_start = time.perf_counter()
    config = og.Config(args.model_dir)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": args.threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def generate(prompts: list[list[int]], n: int, stamps: list | None = None) -> list[list[int]]:
        """One static batch: the prompts right-padded into one [B, width] array, greedy, exactly
        ``n`` new tokens per row (``stamps``: the time each step's tokens were ready)."""
        width = max(len(p) for p in prompts)
        ids = np.full((len(prompts), width), pad, dtype=np.int32)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = p
        params = og.GeneratorParams(model)
        params.set_search_options(batch_size=len(prompts), max_length=width + n, min_length=width + n,
                                  do_sample=False, top_k=1, num_beams=1, repetition_penalty=1.0)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        steps = []
        for _ in range(n):
            gen.generate_next_token()
            steps.append(gen.get_next_tokens().tolist())
            if stamps is not None:
                stamps.append(time.perf_counter())
        assert gen.is_done(), f"the generator is not done after {n} tokens"
        return [list(t) for t in zip(*steps)]

    generate([rows[0]["prompt_token_ids"][:64]], 4)     # warm-up, not timed
    startup_s = time.perf_counter() - t_start           # start-up to ready: load + warm-up

    throughput = []
    for b in rc.batch_sizes(args.batch_sizes):
        n_out = 0
        t0 = time.perf_counter()
        for i in range(0, len(rows), b):
            chunk = rows[i:i + b]
            want = max(int(r["max_tokens"]) for r in chunk)
            out = generate([r["prompt_token_ids"] for r in chunk], want)
            assert all(len(t) == want for t in out), f"generated {[len(t) for t in out]} tokens, wanted {want}"
            n_out += sum(int(r["max_tokens"]) for r in chunk)   # a static batch wastes the rest
        throughput.append(rc.throughput_row(b, rows, time.perf_counter() - t0, n_out, policy="static",
                                            startup_s=startup_s))
        print(f"ort: batch {b}: {throughput[-1]['output_tok_s']:.1f} output tok/s", file=sys.stderr, flush=True)

    n1 = args.decode_tokens
    stamps: list[float] = []
    t0 = time.perf_counter()
    ids = generate([rows[0]["prompt_token_ids"]], n1, stamps)[0]
    single = {"prompt_tokens": len(rows[0]["prompt_token_ids"]), "ttft_s": stamps[0] - t0, "decode_tokens": n1,
              "decode_tok_s": (n1 - 1) / (stamps[-1] - stamps[0]), "token_ids": ids, "startup_s": startup_s}
    peak = rss.stop()
    single["peak_rss_bytes"] = peak
    for row in throughput:
        row["peak_rss_bytes"] = peak

    rc.emit({"peer": "ort", "env": rc.environment("onnxruntime-genai", "onnxruntime", "numpy"),
             "settings": {"model_dir": args.model_dir, **info, "threads": args.threads,
                          "batching": "static batches (one og.Generator per batch), right padding",
                          "cache": "ORT GenAI KV cache, sized by max_length = width + max_tokens"},
             "throughput": throughput, "single": single}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
