"""Peer runner: Hugging Face transformers ``generate`` on the PolicyDesk prompts (hf-venv).

What a user gets from plain transformers: static batches (the whole batch runs until its longest
request is done), left padding, dynamic KV cache, SDPA attention, greedy. The model is kvmesh's
converted checkpoint directory, loaded in ``--dtype`` (bfloat16 by default, as kvmesh's row).
Every request generates exactly its ``max_tokens`` (``min_new_tokens`` holds EOS back). See
runner_common.py for the input and output formats. Usage (from the repo root)::

    ~/.cache/kvmesh/peers/hf-venv/bin/python bench/peers/run_hf.py --model-dir DIR --prompts FILE \
        [--batch-sizes 1,8] [--decode-tokens 128] [--dtype bfloat16] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import sys
import time

import runner_common as rc


def main(argv=None) -> int:
    ap = rc.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="Hugging Face checkpoint directory (kvmesh's converted model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(args.threads)
    rows = rc.load_prompts(args.prompts)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
    gen_cfg = model.generation_config
    eos = gen_cfg.eos_token_id
    pad_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)

    def batch_inputs(chunk: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded [B, L] int64 ids and [B, L] attention mask."""
        width = max(len(r["prompt_token_ids"]) for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, r in enumerate(chunk):
            p = r["prompt_token_ids"]
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids, mask

    def generate(chunk: list[dict], new_tokens: int, streamer=None) -> torch.Tensor:
        ids, mask = batch_inputs(chunk)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                                 streamer=streamer, top_p=None, top_k=None, temperature=None)
        return out[:, ids.shape[1]:]

    generate([{"prompt_token_ids": rows[0]["prompt_token_ids"][:64]}], 4)   # warm-up, not timed

    throughput = []
    for b in rc.batch_sizes(args.batch_sizes):
        n_out = 0
        t0 = time.perf_counter()
        for i in range(0, len(rows), b):
            chunk = rows[i:i + b]
            want = max(int(r["max_tokens"]) for r in chunk)
            new = generate(chunk, want)
            assert new.shape[1] == want, f"generated {new.shape[1]} tokens, wanted {want}"
            n_out += sum(int(r["max_tokens"]) for r in chunk)   # a static batch wastes the rest
        throughput.append(rc.throughput_row(b, rows, time.perf_counter() - t0, n_out, policy="static"))
        print(f"hf: batch {b}: {throughput[-1]['output_tok_s']:.1f} output tok/s", file=sys.stderr, flush=True)

    class Stamps(BaseStreamer):
        """Records the time of every put() after the prompt's (one per generated token at B=1)."""

        def __init__(self):
            self.times, self.prompt_seen = [], False

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.times.append(time.perf_counter())

        def end(self):
            pass

    n1 = args.decode_tokens
    stamps = Stamps()
    t0 = time.perf_counter()
    ids = generate(rows[:1], n1, stamps)[0].tolist()
    single = {"prompt_tokens": len(rows[0]["prompt_token_ids"]), "ttft_s": stamps.times[0] - t0,
              "decode_tokens": n1, "decode_tok_s": (n1 - 1) / (stamps.times[-1] - stamps.times[0]),
              "token_ids": ids}

    rc.emit({"peer": "hf", "env": rc.environment("torch", "transformers", "safetensors"),
             "settings": {"model_dir": args.model_dir, "dtype": args.dtype, "threads": args.threads,
                          "batching": "static batches, left padding", "cache": "DynamicCache",
                          "attention": getattr(model.config, "_attn_implementation", None)},
             "throughput": throughput, "single": single}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
