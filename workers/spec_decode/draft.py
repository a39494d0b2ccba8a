"""Draft-model proposer for speculative decoding (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding", https://arxiv.org/abs/2211.17192; Chen et al. 2023,
https://arxiv.org/abs/2302.01318).

A small model with the target's tokenizer proposes ``k`` tokens per step; the target verifies
them in one forward pass (``workers/spec_decode/rejection.py``). The draft keeps its own paged
KV cache with the same number of blocks and the same block ids as the target's, so a
request's block table addresses both caches: the engine shows the draft every position the
target commits, and the draft writes its own K/V of those positions before it proposes from
them.

The draft writes K/V lazily: a request's committed tokens wait (its *lag*) until a step asks
it for proposals, so a step where no row proposes (speculation capped under load, a request
that cannot speculate, a prefill chunk) costs the draft nothing. One
:meth:`DraftProposer.propose` call is

1. one batched forward over the proposing rows' lagging and new tokens (a mixed batch of
   prefill chunks and single-token rows, laid out decodes first as in
   :mod:`workers.layers.attention`), writing their K/V into the draft cache and proposing one
   token from each row's last position;
2. ``k - 1`` batched single-token decode steps for the rows still proposing, each writing the
   K/V of the previous proposal and proposing the next token.

Blocks whose target K/V the draft has not written are *stale* for the draft (a request that
ends with a lag leaves its blocks stale). A request seen for the first time past position 0 (a
prefix-cache hit) whose cached blocks include a stale one catches up from the first stale block
on, taking those tokens from its prompt (``DraftInput.context``); without them it gets no
proposals. A lag of prompt chunks
is caught up whatever its length (the draft's share of the prefill, paid in the step that
samples the first token), but a lag holding more than :data:`MAX_CATCH_UP` tokens beyond the
step's own is not: such a request decoded without the draft while the batch was large and
continues without it.

With ``draft_vocab_size`` N the draft's lm_head keeps only its first N rows and proposes
only token ids below N (FR-Spec, Zhao et al. 2025, https://arxiv.org/abs/2502.14856: the
lm_head of Qwen2.5-Coder-0.5B, 151,936 rows, is about a quarter of the bytes of its draft step,
docs/spec_decode.md; the first ids of a byte-level BPE vocabulary, in merge order, are the
frequent ones). The
target verifies as before, so greedy output is unchanged; a token past N is never proposed.

Greedy rows propose the argmax. Sampling rows propose from ``q``, the draft's distribution
processed as the target's sampler processes its own (temperature, min-p, top-k, top-p;
penalties are not applied to the draft), and return ``q`` for the rejection sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import SettingsError
from kvmesh.core.sampling import SamplingParams
from workers.checkpoint import load_config
from workers.kv_cache import allocate_kv_cache, bytes_per_block
from workers.layers.attention import (AttentionMetadata, NativeMetadata, PrefillChunk, block_index, layout_key,
                                      set_decode_tables)
from workers.layers.sampler import SAMPLING_EPS, SamplingMetadata, processed_probs, random_sample
from workers.loader import load_model, resolve_weight_format, use_serving_kernels


@dataclass
class DraftInput:
    """One request's share of a :meth:`DraftProposer.propose` call.

    ``token_ids`` are the tokens at positions ``[start, start + len(token_ids))`` whose K/V the
    draft must write (committed tokens the draft has not seen, or has seen with a different
    proposal at that position); ``block_table`` lists the KV block ids covering positions
    ``[0, start + len(token_ids) + num_proposals)``, the same ids as the target's.
    ``num_proposals`` = 0 only writes K/V (a prefill chunk that does not sample).
    ``params`` None or greedy (temperature < 1e-5) → argmax proposals; ``generator``: the
    request's seeded generator (None: the default one). ``context``: the request's tokens
    from position 0 (its prompt), from which the draft writes a cached prefix it has not
    written when it first sees the request past position 0 (None: such a request gets no
    proposals).
    """

    request_id: str
    start: int
    token_ids: list[int]
    block_table: list[int]
    num_proposals: int
    params: SamplingParams | None
    generator: torch.Generator | None = None
    context: list[int] | None = None


@dataclass
class Proposal:
    """``token_ids``: at most ``num_proposals`` proposed tokens ([] past the draft's context
    limit). ``probs``: ``[len(token_ids), vocab]`` float32, the processed draft distribution
    each token was drawn from (sampling rows); None for greedy rows."""

    token_ids: list[int]
    probs: torch.Tensor | None


#: the most tokens of a request's output the draft catches up on in one forward; a request
#: that decoded further without the draft (speculation capped under load) is left to decode
#: without it, rather than stall a step on a long draft prefill when the batch shrinks (a smaller
#: bound also drops the draft from ngram+draft rows whose lookups ran that long: docs/spec_decode.md,
#: "Measurements")
MAX_CATCH_UP = 128


@dataclass
class _Lag:
    """A request's committed tokens whose draft K/V is not written: positions
    ``[start, start + len(tokens))``; the draft's K/V below ``start`` is valid.
    ``prompt_only``: no token of the lag came from a step that sampled (only prompt chunks)."""

    start: int
    tokens: list[int]
    prompt_only: bool = True


@dataclass
class _Row:
    inp: DraftInput
    n_write: int        # tokens written this call (the lag, caught up in one forward; 0: none)
    k: int              # proposals this row makes
    greedy: bool
    tokens: list[int]
    probs: list[torch.Tensor]


class DraftProposer:
    """The draft model and its paged KV cache.

    Args:
        cfg: engine settings: ``draft_model`` (known name or checkpoint directory, resolved
            with :func:`kvmesh.hub.pull.resolve_model`), ``draft_num_layers`` (0 = all),
            ``draft_max_model_len`` (0 = the draft's max_position_embeddings), ``model`` (for
            the vocabulary check), ``max_model_len``, ``dtype`` (weights, activations and the
            draft's KV cache; ``kv_cache_dtype`` applies to the target only), ``weight_format``
            and its settings (the draft's weights are quantized like the target's; not with
            ``draft_num_layers``), ``draft_quantization`` (``q4_1``: its GGUF blocks requantized
            at load), ``draft_vocab_size`` (the lm_head's first N rows: proposals
            only from token ids below N; weight formats ``none`` and ``gguf``).
        num_blocks, block_size: the target's KV pool geometry (same block ids).
        device: where the draft and its cache live.
    Attributes:
        max_model_len: the draft's context limit in tokens: positions at or past it are never
            computed, so longer sequences get no proposals.
        kv_cache_bytes: bytes of the draft's KV cache.
    Raises:
        EngineError: no draft_model, draft vocabulary differs from the target's, bad
            draft_num_layers / draft_max_model_len, draft_num_layers or draft_vocab_size with
            a quantized weight_format, draft_quantization without weight_format gguf, a
            draft_vocab_size the lm_head cannot be cut to, unservable checkpoint, KV allocation
            fails.
    """

    def __init__(self, cfg: EngineConfig, num_blocks: int, block_size: int, device: torch.device,
                 attention_backend: str = "torch", prefill_native: bool = False):
        from kvmesh.hub.pull import resolve_model
        if not cfg.draft_model:
            raise SettingsError("speculative_method 'draft' needs draft_model (--draft-model)")
        draft_dir = resolve_model(cfg.draft_model)
        dcfg = load_config(draft_dir)
        tcfg = load_config(resolve_model(cfg.model))
        if dcfg.vocab_size != tcfg.vocab_size:
            raise SettingsError(f"draft_model {cfg.draft_model!r} has a vocabulary of {dcfg.vocab_size} tokens, "
                                f"the target {cfg.model!r} {tcfg.vocab_size}; the draft must share the target's tokenizer")
        if cfg.draft_num_layers > dcfg.num_layers:
            raise SettingsError(f"draft_num_layers {cfg.draft_num_layers} exceeds the draft's {dcfg.num_layers} layers")
        weight_format = resolve_weight_format(cfg.weight_format, draft_dir)
        if cfg.draft_num_layers and weight_format not in ("none", "gguf"):
            raise SettingsError(f"draft_num_layers cannot be combined with weight_format {cfg.weight_format!r}: "
                                "a truncated draft is served dense")
        cfg.check_draft_weight_format(weight_format)
        if cfg.draft_max_model_len > dcfg.max_position_embeddings:
            raise SettingsError(f"draft_max_model_len {cfg.draft_max_model_len} exceeds the draft's "
                                f"max_position_embeddings {dcfg.max_position_embeddings}")
        limit = cfg.draft_max_model_len or dcfg.max_position_embeddings
        self.max_model_len = min(limit, cfg.max_model_len or min(tcfg.max_position_embeddings, 8192))
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        self.block_size = block_size
        self.model = load_model(draft_dir, dtype=self.dtype, device=self.device, max_positions=self.max_model_len,
                                num_layers=cfg.draft_num_layers or None, weight_format=weight_format,
                                group_size=cfg.quant_group_size, calibration=cfg.enable_calibration,
                                calibration_data=cfg.calibration_data, gguf_requantize=cfg.draft_quantization)
        m = self.model.cfg
        self.vocab_size = m.vocab_size
        #: proposals come from token ids below this: the lm_head's rows (``draft_vocab_size``)
        self.head_size = m.vocab_size
        if 0 < cfg.draft_vocab_size < m.vocab_size:
            try:
                self.model.lm_head.keep_rows(cfg.draft_vocab_size)
            except ValueError as e:
                raise SettingsError(f"draft_vocab_size {cfg.draft_vocab_size}: {e}") from None
            self.head_size = cfg.draft_vocab_size
        use_serving_kernels(self.model, self.dtype, self.device)   # native GEMM / fused ops, bound Linear arguments
        self.kv_cache_bytes = num_blocks * bytes_per_block(m.num_layers, block_size, m.num_kv_heads, m.head_dim,
                                                           self.dtype)
        self.kv_caches = allocate_kv_cache(m.num_layers, num_blocks, block_size, m.num_kv_heads, m.head_dim,
                                           self.dtype, self.device)
        # the target's attention backend (ModelRunner: resolve_attention_backend) where the draft's
        # head size allows it: 'native' attends over the block tables in place, the torch decode
        # path gathers each row's context first (the draft's forwards then cost more than the
        # target's decode: docs/spec_decode.md, "Measurements")
        self.native = attention_backend == "native" and m.head_dim % 8 == 0
        self.prefill_native = self.native and prefill_native
        self._lag: dict[str, _Lag] = {}      # request id -> tokens the draft has not written
        self._blind: set[str] = set()        # requests whose cached context the draft cannot see
        self._stale: set[int] = set()        # block ids holding target K/V the draft has not written

    # ---- batch preparation ----------------------------------------------------------
    def _prepare(self, chunks: list[tuple[int, list[int], list[int]]]):
        """Tensors for one forward over ``chunks`` = [(start, token_ids, block_table)]: input
        ids ``[T]`` and positions ``[T]`` int64, the AttentionMetadata, and the batch index of
        each chunk's last token (in ``chunks`` order). Layout as the target's
        (:meth:`workers.input_batch.InputBatch.prepare`): single-token chunks first, then the
        short chunks after cached context, then the others; on the native backend the kernel
        takes the leading ones (all of them with ``prefill_native``), the rest go through SDPA."""
        bs, dev = self.block_size, self.device

        keys = [layout_key(len(toks), start) for start, toks, _ in chunks]
        order = sorted(range(len(chunks)), key=keys.__getitem__)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last = [0] * len(chunks)
        dec_tables, dec_lens = [], []
        prefills: list[PrefillChunk] = []
        native_rows: list[tuple[int, int, list[int]]] = []       # (query rows, keys, block table)
        for i in order:
            start, toks, bt = chunks[i]
            n, q_start = len(toks), len(ids)
            ids += toks
            pos += range(start, start + n)
            slots += [bt[p // bs] * bs + p % bs for p in range(start, start + n)]
            last[i] = len(ids) - 1
            if self.native and (self.prefill_native or not keys[i][1]):
                native_rows.append((n, start + n, bt[: -(-(start + n) // bs)]))
            if n == 1:
                dec_tables.append(bt[: start // bs + 1])
                dec_lens.append(start + 1)
            else:
                prefills.append(PrefillChunk(q_start, q_start + n, start,
                                             block_index(bt[: -(-(start + n) // bs)], dev)))
        md = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                               num_decode_tokens=len(dec_lens), prefills=prefills)
        if self.native:
            md.native = _native_metadata(native_rows, dev)
        elif dec_lens:
            set_decode_tables(md, dec_tables, dec_lens, bs, self.dtype, dev)
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                md, last)

    # ---- proposing ------------------------------------------------------------------
    def _propose_next(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """One token per row from ``logits`` ``[B, head_size]`` (token ids ``[0, head_size)``):
        argmax for greedy rows; for sampling rows a draw from the processed distribution q,
        appended to the row's probs as ``[V]`` (zero past ``head_size``: q is the distribution the
        draw came from, which keeps the rejection sampler exact)."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        samp = [i for i, r in enumerate(rows) if not r.greedy]
        if samp:
            params = [rows[i].inp.params for i in samp]
            md = SamplingMetadata.build(params, [[]] * len(samp), [[]] * len(samp),
                                        [rows[i].inp.generator for i in samp], self.head_size, self.device)
            q = processed_probs(logits[samp], md)
            tokens[samp] = random_sample(q, md.generators)
            if self.head_size < self.vocab_size:
                q = torch.nn.functional.pad(q, (0, self.vocab_size - self.head_size))
            for j, i in enumerate(samp):
                rows[i].probs.append(q[j])
        return tokens.tolist()

    def _catch_up(self, live: list[_Row]) -> None:
        """One forward over every row's new tokens (their K/V into the draft cache) and the
        first proposal of each row that proposes."""
        ids, pos, md, last = self._prepare([(r.inp.start, r.inp.token_ids[: r.n_write], r.inp.block_table)
                                            for r in live])
        hidden = self.model(ids, pos, md, self.kv_caches)
        live = [(r, i) for r, i in zip(live, last) if r.k]
        if live:
            logits = self.model.compute_logits(hidden[[i for _, i in live]])
            for (r, _), t in zip(live, self._propose_next(logits, [r for r, _ in live])):
                r.tokens.append(t)

    def _blocks(self, block_table: list[int], start: int, end: int) -> list[int]:
        """The block ids of ``block_table`` covering positions ``[start, end)``."""
        bs = self.block_size
        return block_table[start // bs: -(-end // bs)] if end > start else []

    def _track(self, inp: DraftInput, written: set[int]) -> _Lag | None:
        """Add ``inp``'s tokens to its request's lag; None for a request the draft cannot see.
        ``written``: blocks this call writes (not stale for a request seen for the first time:
        each layer writes the whole batch's K/V before any row attends)."""
        rid = inp.request_id
        if rid in self._blind:
            return None
        lag = self._lag.get(rid)
        cached = self._blocks(inp.block_table, 0, inp.start) if lag is None else []
        first_stale = next((i for i, b in enumerate(cached) if b in self._stale and b not in written), None)
        if first_stale is not None:
            # a cached prefix the draft has not written: from the request's prompt, or never
            pos = first_stale * self.block_size
            if inp.context is not None and len(inp.context) >= inp.start:
                lag = self._lag[rid] = _Lag(pos, list(inp.context[pos: inp.start]))
        elif lag is None:
            lag = self._lag[rid] = _Lag(inp.start, [])
        elif inp.start < lag.start:                        # rewritten from an earlier position
            lag.start, lag.tokens = inp.start, []
        elif inp.start <= lag.start + len(lag.tokens):     # replaces the lag's tail (a rejection)
            del lag.tokens[inp.start - lag.start:]
        else:                                              # a gap the proposer never saw
            lag = None
        if lag is not None and inp.num_proposals and not lag.prompt_only and len(lag.tokens) > MAX_CATCH_UP:
            lag = None                                     # left behind under load: too far to catch up
        if lag is None:
            self._blind.add(rid)
            self._lag.pop(rid, None)
            return None
        lag.tokens += inp.token_ids
        if inp.params is not None and not inp.num_proposals:
            lag.prompt_only = False                        # a decode step the draft sat out
        return lag

    @torch.inference_mode()
    def propose(self, inputs: list[DraftInput]) -> dict[str, Proposal]:
        """Record the K/V every input's ``token_ids`` needs; for the inputs asking for proposals,
        write their lag's K/V and propose up to ``num_proposals`` tokens (fewer near
        :attr:`max_model_len`: a proposal at position p needs ``p < max_model_len``; none for a
        request the draft cannot see). Returns {request_id: Proposal} for every input."""
        L = self.max_model_len
        rows: dict[str, _Row] = {}
        writes: list[tuple[DraftInput, _Lag]] = []
        stale: list[tuple[list[int], int, int]] = []      # (block table, start, end) the draft skips
        written: set[int] = set()
        # requests already seen first: their writes may cover the cached blocks of a new one
        for inp in sorted(inputs, key=lambda i: i.request_id not in self._lag):
            lag = self._track(inp, written)
            sp = inp.params
            row = rows[inp.request_id] = _Row(DraftInput(inp.request_id, inp.start, [], inp.block_table, 0, sp,
                                                         inp.generator),
                                              0, 0, sp is None or sp.temperature < SAMPLING_EPS, [], [])
            end = inp.start + len(inp.token_ids)
            if lag is None or not inp.num_proposals or not lag.tokens or end > L:
                stale.append((inp.block_table, inp.start, end))
                continue
            row.inp = DraftInput(inp.request_id, lag.start, lag.tokens, inp.block_table, inp.num_proposals,
                                 sp, inp.generator)
            row.n_write = len(lag.tokens)
            row.k = max(0, min(inp.num_proposals, L - end))
            writes.append((row.inp, lag))
            written.update(self._blocks(inp.block_table, lag.start, end))
        # nothing written there: those blocks now hold target K/V the draft lacks
        for bt, start, end in stale:
            self._stale.update(self._blocks(bt, start, end))
        rows = [rows[inp.request_id] for inp in inputs]

        # step 0: the lagging and new tokens of every proposing row; a proposal from each row's
        # last position (record_function labels: the phases bench.profile reports)
        live = [r for r in rows if r.n_write]
        if live:
            with torch.profiler.record_function("draft_catch_up"):
                self._catch_up(live)
            for inp, lag in writes:
                end = inp.start + len(inp.token_ids)
                self._stale.difference_update(self._blocks(inp.block_table, inp.start, end))
                lag.start, lag.tokens, lag.prompt_only = end, [], False

        # steps 1..k-1: feed the previous proposal, propose the next
        for step in range(1, max((r.k for r in rows), default=0)):
            with torch.profiler.record_function("draft_decode"):
                live = [r for r in rows if r.k > step]
                ids, pos, md, _ = self._prepare([(r.inp.start + len(r.inp.token_ids) + step - 1, [r.tokens[-1]],
                                                  r.inp.block_table) for r in live])
                logits = self.model.compute_logits(self.model(ids, pos, md, self.kv_caches))
                for r, t in zip(live, self._propose_next(logits, live)):
                    r.tokens.append(t)

        out = {}
        for r in rows:
            probs = None
            if not r.greedy:
                probs = (torch.stack(r.probs) if r.probs
                         else torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device))
            out[r.inp.request_id] = Proposal(r.tokens, probs)
        return out

    def free_requests(self, request_ids: list[str]) -> None:
        """Forget the requests' lags (their blocks stay stale for the draft) and blindness; the
        draft's K/V lives in the requests' blocks (freed by the block manager) and generators
        belong to the target's runner."""
        for rid in request_ids:
            self._lag.pop(rid, None)
            self._blind.discard(rid)


def _native_metadata(rows: list[tuple[int, int, list[int]]], device: torch.device) -> NativeMetadata:
    """The native kernel's sequences, ``rows`` = [(query rows, keys, block table)] in batch
    order: ``query_start_loc`` ``[S + 1]``, ``seq_lens`` ``[S]`` and the tables ``[S, W]``
    zero-padded (W at least 1), all int32."""
    i32 = torch.int32
    counts = [n for n, _, _ in rows]
    qsl = torch.zeros(len(rows) + 1, dtype=i32)
    if rows:
        torch.cumsum(torch.tensor(counts, dtype=i32), 0, out=qsl[1:])
    width = max([1] + [len(bt) for _, _, bt in rows])
    tables = torch.tensor([bt + [0] * (width - len(bt)) for _, _, bt in rows], dtype=i32).reshape(len(rows), width)
    return NativeMetadata(sum(counts), qsl.to(device), torch.tensor([k for _, k, _ in rows], dtype=i32).to(device),
                          tables.to(device))
