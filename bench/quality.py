"""Quality of a serving configuration (KV cache dtype, weight format): perplexity on the
PolicyDesk policy texts and the KL divergence of its next-token distributions from a
reference configuration's (by default the same model, dense weights, KV in the model dtype).

Each text goes through the engine's own serving path: a :class:`workers.model_runner.ModelRunner`
built from the :class:`kvmesh.core.engine_config.EngineConfig` (its weight format, its KV cache dtype), fed
in chunks of ``chunk`` tokens (default 64) that attend to the earlier chunks through the paged
KV cache (prefill with context: the chunk's K/V is written to the cache and read back, quantized
if the cache is), or token by token (``chunk=1``: the decode path, blocks filled one token at a
time). The log-softmax of the logits is taken at every position.

- perplexity: ``exp(mean NLL)`` of each next token (position i predicts token i+1), averaged
  over all predicted positions of all texts;
- KL: ``KL(p_ref || p_test) = sum_v p_ref(v) (log p_ref(v) - log p_test(v))`` at each predicted
  position, averaged over positions (nats). The reference's log-probabilities are computed once
  and kept in memory (``--reference-cache FILE`` also keeps them on disk) and reused for every
  configuration compared.

Usage::

    python -m bench.quality --model smollm2-135m-instruct --kv-cache-dtype int8 fp8 [--weight-format int4]
        [--max-tokens 2048] [--chunk 64] [--out rows.json]
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

import policydesk
from bench import command
from bench.markdown import add_output_args
from kvmesh.core.engine_config import EngineConfig

CHUNK = 64


def _resolved(cfg: EngineConfig):
    from workers.checkpoint import load_config
    from kvmesh.hub.pull import resolve_model
    model_dir = resolve_model(cfg.model)
    m = load_config(model_dir)
    return cfg.replace(max_model_len=cfg.max_model_len or min(m.max_position_embeddings, 8192)), model_dir


def tokenize(cfg: EngineConfig, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of ``texts`` (the model's tokenizer), in order, until ``max_tokens`` tokens in all;
    each text also at most ``max_model_len`` tokens; texts left with fewer than 2 tokens are dropped."""
    from transformers import AutoTokenizer
    cfg, model_dir = _resolved(cfg)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out, left = [], max_tokens
    for t in texts:
        ids = tok.encode(t)[: min(left, cfg.max_model_len)]
        if len(ids) >= 2:
            out.append(ids)
            left -= len(ids)
        if left < 2:
            break
    return out


@torch.inference_mode()
def logprobs(cfg: EngineConfig, token_ids: list[list[int]], chunk: int = CHUNK) -> list[torch.Tensor]:
    """Log-softmax of the next-token logits at every position but the last of each sequence:
    one ``[len(ids) - 1, vocab]`` float32 tensor per sequence (CPU).

    The model runner of ``cfg`` (its weights, its KV cache dtype) runs each sequence alone in
    chunks of ``chunk`` tokens through a KV pool just large enough for the longest sequence;
    ``chunk == 1`` uses the decode path. Raises EngineError for a bad configuration."""
    from workers.layers.attention import AttentionMetadata, PrefillChunk, block_index
    from workers.model_runner import ModelRunner

    cfg, model_dir = _resolved(cfg)
    bs = cfg.block_size
    longest = max(len(ids) for ids in token_ids)
    runner = ModelRunner(cfg, str(model_dir), num_blocks=-(-longest // bs))
    dev = runner.device
    out = []
    for ids in token_ids:
        rows = []
        for start in range(0, len(ids) - 1, chunk):
            n = min(chunk, len(ids) - 1 - start)         # the last token is never an input
            table = list(range(-(-(start + n) // bs)))   # blocks 0.. : one sequence at a time
            pos = torch.arange(start, start + n, device=dev)
            md = AttentionMetadata(slot_mapping=pos)      # block b holds positions [b*bs, (b+1)*bs)
            if n == 1:                                   # a decode row: the decode attention path
                width = len(table)
                md.num_decode_tokens = 1
                md.decode_block_tables = block_index(table, dev)
                md.decode_seq_lens = torch.tensor([start + 1], device=dev)
                valid = torch.arange(width * bs, device=dev) < start + 1
                md.decode_mask = torch.zeros(width * bs, dtype=runner.dtype, device=dev).masked_fill_(
                    ~valid, float("-inf"))[None, None, None, :]
            else:
                md.prefills = [PrefillChunk(0, n, start, block_index(table, dev))]
            x = torch.tensor(ids[start:start + n], dtype=torch.long, device=dev)
            hidden = runner.model(x, pos, md, runner.kv_caches)
            rows.append(torch.log_softmax(runner.model.compute_logits(hidden), dim=-1).cpu())
        out.append(torch.cat(rows))
    return out


def evaluate(cfg: EngineConfig, texts: list[str], reference_cfg: EngineConfig | None = None,
             max_tokens: int = 2048, chunk: int = CHUNK,
             reference: list[torch.Tensor] | None = None) -> dict:
    """Perplexity of ``cfg`` on ``texts`` and, against ``reference_cfg`` (or precomputed
    ``reference`` log-probs from :func:`logprobs` on the same tokens), the mean KL divergence
    of the next-token distributions.

    Returns ``{"perplexity": float, "kl": float | None (nats per position), "tokens": int
    (predicted positions), "seconds": float (wall time of cfg's pass)}``."""
    token_ids = tokenize(cfg, texts, max_tokens)
    if reference is None and reference_cfg is not None:
        reference = logprobs(reference_cfg, token_ids, chunk)
    t0 = time.perf_counter()
    test = logprobs(cfg, token_ids, chunk)
    seconds = time.perf_counter() - t0
    nll, kl, n = 0.0, 0.0, 0
    for i, (ids, lp) in enumerate(zip(token_ids, test)):
        targets = torch.tensor(ids[1:])
        nll -= lp.gather(1, targets[:, None]).sum().item()
        n += len(targets)
        if reference is not None:
            ref = reference[i]
            if ref.shape != lp.shape:
                raise ValueError(f"reference log-probs of text {i} have shape {tuple(ref.shape)}, "
                                 f"expected {tuple(lp.shape)}")
            for r in range(0, len(lp), 256):         # in slices: [n, vocab] temporaries are large
                kl += (ref[r:r + 256].exp() * (ref[r:r + 256] - lp[r:r + 256])).sum().item()
    return {"perplexity": math.exp(nll / n), "kl": kl / n if reference is not None else None,
            "tokens": n, "seconds": seconds}


def main(argv=None) -> int:
    ap = command.parser(__doc__)
    ap.add_argument("--dtype", default="auto", help="weights/activations dtype (also the reference's)")
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="KV dtypes to evaluate")
    ap.add_argument("--weight-format", nargs="+", default=["none"], help="weight formats to evaluate")
    ap.add_argument("--max-tokens", type=int, default=2048, help="tokens of policy text evaluated, in all "
                    "(log-probs take tokens x vocab x 4 bytes per configuration)")
    ap.add_argument("--chunk", type=int, default=CHUNK, help="prefill chunk (1 = token by token, decode path)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--reference-cache", metavar="FILE", help="load the reference log-probs from FILE if it "
                    "matches (model, dtype, tokens, chunk), else compute and save them there")
    add_output_args(ap, table=False)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = EngineConfig(model=args.model, dtype=args.dtype, block_size=args.block_size)
    texts = policydesk.policy_texts()
    token_ids = tokenize(base, texts, args.max_tokens)
    key = {"model": args.model, "dtype": str(base.torch_dtype), "tokens": token_ids, "chunk": args.chunk}
    reference = None
    if args.reference_cache and Path(args.reference_cache).is_file():
        saved = torch.load(args.reference_cache)
        if saved["key"] == key:
            reference = saved["logprobs"]
    if reference is None:
        reference = logprobs(base, token_ids, args.chunk)
        if args.reference_cache:
            torch.save({"key": key, "logprobs": reference}, args.reference_cache)
    rows = []
    print(f"{'weights':>10} {'kv':>9} {'ppl':>9} {'kl (nats)':>11} {'tokens':>7}")
    for wf in args.weight_format:
        for kv in args.kv_cache_dtype:
            cfg = base.replace(weight_format=wf, kv_cache_dtype=kv)
            r = evaluate(cfg, texts, max_tokens=args.max_tokens, chunk=args.chunk, reference=reference)
            rows.append({"model": args.model, "dtype": str(base.torch_dtype).removeprefix("torch."),
                         "weight_format": wf, "kv_cache_dtype": kv, "chunk": args.chunk, **r})
            print(f"{wf:>10} {kv:>9} {r['perplexity']:9.4f} {r['kl']:11.2e} {r['tokens']:7d}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
