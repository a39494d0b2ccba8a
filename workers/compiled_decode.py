"""The decode step compiled with ``torch.compile`` (Inductor): the CPU stand-in for CUDA graphs.

A decode-only step (every sequence adds one token; the native attention backend) runs each
decoder layer as a compiled graph: Inductor fuses the elementwise work of the layer (residual
add + RMSNorm, rotary, SiLU-and-mul, casts) into C++ loops and calls the GEMMs and the
paged-attention custom ops (:mod:`workers.kernels`, opaque to the compiler) directly, so a
layer costs a handful of calls instead of ~35 eager op dispatches.

One graph serves every layer: ``DecoderLayer.forward`` is compiled as a function of the layer
(Dynamo treats a module argument's weights as graph inputs), so a bucket costs two traces (the
first layer, without a residual yet, and the rest) instead of one trace of the whole model,
which compiles several times slower (docs/engine.md, "Compiled decode step").

Shapes: the batch dimension is padded up to a bucket (powers of two up to ``max_num_seqs``;
SGLang's CPU graph runner does the same, PR #7843), so each bucket is one graph compiled once
and replayed; padding rows decode token 0 at position 0 with their K/V slot -1 (not written)
and a one-token context, and their outputs are dropped. Block tables are padded to the
widest a sequence can need (``max_model_len / block_size``), so their width never changes
the graph. Inductor's compiled code is cached on disk (``TORCHINDUCTOR_CACHE_DIR``, default
``kvmesh_home()/inductor``), so a restart only re-traces. Every bucket is compiled when the
model runner starts (:meth:`CompiledDecode.warmup`, a line on stderr before and after).

Prefill steps, mixed steps, steps with speculative verify chunks and the torch attention
backend stay eager, and so does every step after a compile failure (logged once).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from kvmesh.hub.cache import kvmesh_home
from workers.layers.attention import AttentionMetadata, NativeMetadata

log = logging.getLogger("kvmesh.workers")


def inductor_cache_dir() -> Path:
    """Where Inductor keeps compiled code: ``TORCHINDUCTOR_CACHE_DIR`` if set, else
    ``kvmesh_home()/inductor`` (:func:`kvmesh.hub.cache.kvmesh_home`, the root of the models and
    the kernel cache too); set in the environment so that Inductor's compile workers see it too."""
    d = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not d:
        d = str(kvmesh_home() / "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    return Path(d)


def buckets(max_num_seqs: int) -> list[int]:
    """Batch buckets: 1, 2, 4, ... up to and including ``max_num_seqs``."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max_num_seqs]


class CompiledDecode:
    """Runs decode-only steps of ``model`` with compiled decoder layers, per batch bucket.

    Args:
        model: the stage's :class:`workers.models.llama.LlamaForCausalLM` (eval, no grad).
        kv_caches: the stage's per-layer KV caches (mutated in place by the custom ops).
        max_num_seqs: the largest batch (the last bucket).
        max_blocks: block-table width every row is padded to (``ceil(max_model_len / block_size)``).
        device: where the step's tensors live.
    """

    def __init__(self, model, kv_caches, max_num_seqs: int, max_blocks: int, device: torch.device):
        inductor_cache_dir()
        self.model, self.kv_caches = model, kv_caches
        self.buckets = buckets(max_num_seqs)
        self.max_blocks = max_blocks
        self.device = device
        self.hidden_size = model.cfg.hidden_size
        self.compiled: set[int] = set()
        self.calls = 0                      # steps run (warm-up included)
        self.failed: str | None = None      # why compiled steps stopped (run_or_none)
        from workers.models.llama import DecoderLayer
        # two graphs per bucket (the first layer has no residual yet), for every engine of the
        # process (each model's layers are new modules): Dynamo's default limit of 8 graphs per
        # function would stop at the fifth bucket
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
        self._layer = torch.compile(DecoderLayer.forward, dynamic=False, fullgraph=True)

    def _fn(self, x, positions, slot_mapping, qsl, seq_lens, block_tables, prefix_group,
            prefix_block_tables, prefix_lens):
        """The model's forward (:meth:`LlamaForCausalLM.forward`) with compiled layers."""
        nm = NativeMetadata(x.shape[0], qsl, seq_lens, block_tables, prefix_group, prefix_block_tables, prefix_lens)
        md = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=x.shape[0], native=nm)
        m = self.model
        h = m.embed_tokens(x) if m.is_first else x
        cos_sin = m.rope.cos_sin(positions, h.dtype)
        residual = None
        for layer, kv in zip(m.layers, self.kv_caches):
            h, residual = self._layer(layer, h, residual, cos_sin, md, kv)
        if residual is None:
            return m.norm(h) if m.is_last else h
        return m.norm(h, residual)[0] if m.is_last else h + residual

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` rows (None: more rows than the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def accepts(self, md: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only native step (one query row per sequence) that fits a bucket."""
        nm = md.native
        return (nm is not None and not md.prefills and nm.num_tokens == num_tokens
                and nm.query_start_loc.shape[0] == num_tokens + 1 and self.bucket(num_tokens) is not None)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a step that :meth:`accepts`; ``x``: ``[T]`` token ids
        (first stage) or ``[T, hidden]`` hidden states (later stages)."""
        n = x.shape[0]
        b = self.bucket(n)
        self.calls += 1
        nm = md.native
        pad = b - n
        dev, i32 = self.device, torch.int32
        W = self.max_blocks

        def rows(t: torch.Tensor, fill) -> torch.Tensor:
            if not pad:
                return t
            return torch.cat((t, torch.full((pad, *t.shape[1:]), fill, dtype=t.dtype, device=dev)))

        bt = torch.zeros(b, W, dtype=i32, device=dev)
        bt[:n, : nm.block_tables.shape[1]] = nm.block_tables
        pbt = torch.zeros(b, W, dtype=i32, device=dev)
        if nm.prefix_group is not None:
            pbt[: nm.prefix_block_tables.shape[0], : nm.prefix_block_tables.shape[1]] = nm.prefix_block_tables
            pg = rows(nm.prefix_group, -1)
            pl = torch.zeros(b, dtype=i32, device=dev)
            pl[: nm.prefix_lens.shape[0]] = nm.prefix_lens
        else:
            pg = torch.full((b,), -1, dtype=i32, device=dev)
            pl = torch.zeros(b, dtype=i32, device=dev)
        args = (rows(x, 0), rows(positions, 0), rows(md.slot_mapping, -1),
                torch.arange(b + 1, dtype=i32, device=dev), rows(nm.seq_lens, 1), bt, pg, pbt, pl)
        if b not in self.compiled:
            t0 = time.perf_counter()
            out = self._fn(*args)
            self.compiled.add(b)
            log.info("kvmesh: compiled the decode step for batch %d in %.1f s", b, time.perf_counter() - t0)
        else:
            out = self._fn(*args)
        return out[:n]

    def run_or_none(self, x: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor | None:
        """:meth:`__call__`, or None (the caller runs the step eagerly) once compiling has failed:
        the first failure is logged and compiled steps stop for this engine. A compile failure
        happens before any K/V is written (Dynamo traces and compiles before the graph runs)."""
        if self.failed is not None:
            return None
        try:
            return self(x, positions, md)
        except Exception as e:       # noqa: BLE001 - torch._dynamo raises many kinds
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log.warning("kvmesh: compiled decode step failed (%s); decode steps run eager from now on", self.failed)
            return None

    def warmup(self, first_stage: bool, dtype: torch.dtype, progress=None) -> float:
        """Compile every bucket now with padding-only batches (nothing is written to the KV
        cache), with a line on stderr before and after. ``progress(done, total, bucket)`` is
        called after each bucket; returns seconds."""
        import sys
        print(f"kvmesh: compiling the decode step for batch buckets {self.buckets} "
              f"(Inductor cache: {inductor_cache_dir()})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        md_dtype = torch.int32
        for i, b in enumerate(self.buckets):
            x = (torch.zeros(b, dtype=torch.long, device=self.device) if first_stage
                 else torch.zeros(b, self.hidden_size, dtype=dtype, device=self.device))
            nm = NativeMetadata(b, torch.arange(b + 1, dtype=md_dtype, device=self.device),
                                torch.ones(b, dtype=md_dtype, device=self.device),
                                torch.zeros(b, 1, dtype=md_dtype, device=self.device))
            md = AttentionMetadata(slot_mapping=torch.full((b,), -1, dtype=torch.long, device=self.device),
                                   num_decode_tokens=b, native=nm)
            if self.run_or_none(x, torch.zeros(b, dtype=torch.long, device=self.device), md) is None:
                break
            if progress is not None:
                progress(i + 1, len(self.buckets), b)
        took = time.perf_counter() - t0
        print(f"kvmesh: decode step compiled in {took:.1f} s", file=sys.stderr, flush=True)
        return took
