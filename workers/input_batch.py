"""The model runner's persistent input batch: block tables that live across steps.

vLLM v1 keeps its GPU model runner's inputs in an ``InputBatch`` whose ``BlockTable`` rows are
updated in place each step; :class:`InputBatch` is this engine's version. Each request that
the runner sees gets a *row* of a preallocated ``[R, W]`` int32 block table (``R`` rows, grown
on demand; ``W`` block columns, ``ceil(max_model_len / block_size)``, grown on demand). A step
writes only what changed: the blocks a running request gained since its last step, the whole
table of a request new to the batch (or of one whose table changed in its stored part:
preemption by recompute, or a request id reused), zeros over the tail a table lost (speculative
decoding's trimmed lookahead blocks). :meth:`InputBatch.remove` (``ModelRunner.free_requests``:
finished and aborted requests) frees rows; a preempted request keeps its row until it comes
back. Rows not referenced for ``STALE_STEPS`` steps are reclaimed when no row is free, before
the table grows, so a request that is never removed cannot make it grow without bound.

From the rows, :meth:`InputBatch.prepare` computes the step's tensors with vectorized ops:
positions, the slot mapping ``block_table[row, pos // bs] * bs + pos % bs``, sequence
lengths, and the block tables of the native kernel and of the torch decode path (the step's
rows gathered with ``index_select``, narrowed to the widest row, each row zeroed past the blocks
its sequence needs, which is exactly the zero-padded table of the old list-based preparation).

Each ``SeqInput`` carries its whole block table (rebuilt from the step message's new blocks by
:class:`workers.step.StepDecoder`, in-process and on each Ray pipeline stage alike); the batch
compares it with the stored copy (a C-level list comparison) instead of rebuilding
tensors from it. Each pipeline stage's runner keeps its own batch; they see the same steps, so
they hold the same rows.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from workers.layers.attention import (AttentionMetadata, CascadeGroup, NativeMetadata, PrefillChunk, block_index,
                                      layout_key, set_decode_tensors)
from workers.step import SeqInput

CASCADE_MIN_BLOCKS = 4   # shorter shared prefixes are not worth a separate pass
STALE_STEPS = 32         # a row unreferenced this many steps may be reclaimed when no row is free


class InputBatch:
    """Preallocated per-request block tables, updated incrementally from each step's sequences.

    Args:
        max_rows: rows to preallocate (``max_num_seqs``); more live requests grow the table.
        max_blocks: block columns to preallocate (``ceil(max_model_len / block_size)``); a
            longer block table grows it.
        block_size: tokens per KV block.
        device: where the step tensors :meth:`prepare` returns live; the persistent tensors
            stay on the CPU.

    Attributes:
        block_table: ``[R, W]`` int32 (CPU). A live row ``r`` holds its request's block ids in
            ``[:num_blocks[r]]`` and zeros after them; a free row's contents are unspecified.
        num_blocks: ``[R]`` int32 (CPU), block ids stored in each row (0 for a free row).
        row_of: request id -> its row.
        free_rows: rows without a request (``pop()`` gives the lowest).
    """

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        rows, width = max(1, max_rows), max(1, max_blocks)
        self.block_size = block_size
        self.device = torch.device(device)
        self.block_table = torch.zeros(rows, width, dtype=torch.int32)
        self.num_blocks = torch.zeros(rows, dtype=torch.int32)
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = list(range(rows - 1, -1, -1))
        self._ids: list[str | None] = [None] * rows        # request id of each row
        self._stored: list[list[int]] = [[] for _ in range(rows)]   # block ids in each row (its tensor copy)
        self._last_step = [0] * rows                        # the step that last referenced each row
        self.step = 0
        self._lock = threading.Lock()   # free_requests may come from another thread than execute

    @property
    def num_rows(self) -> int:
        return self.block_table.shape[0]

    # ---- rows ------------------------------------------------------------------------
    def remove(self, request_ids: Sequence[str]) -> None:
        """Free the rows of ``request_ids`` (finished or aborted requests); unknown ids are ignored."""
        with self._lock:
            for rid in request_ids:
                row = self.row_of.pop(rid, None)
                if row is not None:
                    self._free(row)

    def _free(self, row: int) -> None:
        """Zero ``row`` and put it on the free list (its request id already unmapped)."""
        self.block_table[row, : len(self._stored[row])] = 0
        self.num_blocks[row] = 0
        self._stored[row] = []
        self._ids[row] = None
        self.free_rows.append(row)

    def _grow(self, rows: int, width: int) -> None:
        """Enlarge the tables to at least ``rows`` x ``width`` (doubling), keeping their contents."""
        r0, w0 = self.block_table.shape
        r, w = max(rows, 2 * r0) if rows > r0 else r0, max(width, 2 * w0) if width > w0 else w0
        bt = torch.zeros(r, w, dtype=torch.int32)
        bt[:r0, :w0] = self.block_table
        self.block_table = bt
        if r > r0:
            nb = torch.zeros(r, dtype=torch.int32)
            nb[:r0] = self.num_blocks
            self.num_blocks = nb
            self._ids += [None] * (r - r0)
            self._stored += [[] for _ in range(r - r0)]
            self._last_step += [0] * (r - r0)
            self.free_rows += range(r - 1, r0 - 1, -1)

    def _new_row(self, request_id: str) -> int:
        """A free row for ``request_id``: a free one, else one unreferenced for ``STALE_STEPS``
        steps (its request loses it: it is rewritten if it comes back), else a new one."""
        if not self.free_rows:
            stale = [r for r, rid in enumerate(self._ids)
                     if rid is not None and self._last_step[r] <= self.step - STALE_STEPS]
            for r in sorted(stale, reverse=True):
                del self.row_of[self._ids[r]]
                self._free(r)
            if not self.free_rows:
                self._grow(self.num_rows + 1, 0)
        row = self.free_rows.pop()
        self.row_of[request_id] = row
        self._ids[row] = request_id
        return row

    def update(self, seqs: Sequence[SeqInput]) -> list[int]:
        """Bring the rows of ``seqs`` up to date with their block tables; returns their rows
        (in ``seqs`` order). Writes only the block ids beyond a row's stored prefix, or the
        whole table when the stored part differs; all writes go in one indexed store."""
        with self._lock:
            self.step += 1
            rows: list[int] = []
            w_rows: list[int] = []
            w_cols: list[int] = []
            w_vals: list[int] = []
            nb_rows: list[int] = []
            nb_vals: list[int] = []
            for s in seqs:
                bt = s.block_table
                row = self.row_of.get(s.request_id)
                if row is None:
                    row = self._new_row(s.request_id)
                self._last_step[row] = self.step
                rows.append(row)
                old = self._stored[row]
                n, m = len(old), len(bt)
                if n == m and (n == 0 or bt[-1] == old[-1]) and bt == old:
                    continue
                keep = min(n, m)
                if bt[:keep] != old[:keep]:
                    keep = 0            # a changed stored part: rewrite the row
                if m > self.block_table.shape[1]:
                    self._grow(0, m)
                if m > keep:
                    w_rows += [row] * (m - keep)
                    w_cols += range(keep, m)
                    w_vals += bt[keep:]
                if n > m:
                    self.block_table[row, m:n] = 0
                self._stored[row] = list(bt)
                nb_rows.append(row)
                nb_vals.append(m)
            if w_rows:
                self.block_table[torch.tensor(w_rows), torch.tensor(w_cols)] = torch.tensor(w_vals, dtype=torch.int32)
            if nb_rows:
                self.num_blocks[torch.tensor(nb_rows)] = torch.tensor(nb_vals, dtype=torch.int32)
            return rows

    def gather(self, rows: torch.Tensor, lens: torch.Tensor, width: int,
               shift: torch.Tensor | None = None) -> torch.Tensor:
        """Block tables of ``rows`` (``[n]`` int64): ``[n, width]`` int32, row i holding the
        blocks that cover ``lens[i]`` tokens (``[n]`` int64), zeros after. ``shift`` (``[n]``
        int64): row i starts at its block ``shift[i]`` (a cascade group's stripped prefix;
        ``lens`` then counts the tokens after it)."""
        w = width if shift is None else min(width + int(shift.max()), self.block_table.shape[1])
        t = self.block_table[:, :w].index_select(0, rows)
        if shift is not None:
            cols = (torch.arange(width)[None, :] + shift[:, None]).clamp_(max=w - 1)
            t = t.gather(1, cols)
        need = (lens + self.block_size - 1) // self.block_size
        return t.masked_fill_(torch.arange(width)[None, :] >= need[:, None], 0)

    # ---- one step --------------------------------------------------------------------
    def prepare(self, seqs: Sequence[SeqInput], *, native: bool, quantized: bool, cascade: bool,
                dtype: torch.dtype, prefill_native: bool = False):
        """Tensors of one step over ``seqs`` (any order).

        Args:
            native: the native kernels compute attention (:class:`NativeMetadata`).
            quantized: the KV cache is int8/fp8 (every chunk after context goes native).
            cascade: group decode rows sharing a prefix (prefix caching on; on the native
                backend where the kernel's many-row path is fast, :func:`workers.kernels.prefill_in_kernel`).
            dtype: the model dtype (the torch decode mask's).
            prefill_native: every chunk goes native too, the SDPA chunks included
                (:func:`workers.kernels.prefill_in_kernel`); the order stays the same.
        Returns:
            ``(input_ids [T] int64, positions [T] int64, AttentionMetadata, sample_idx,
            sample_seqs)``: tokens laid out decodes first, then the short chunks after cached
            context, then chunks without context or with at least ``SDPA_MIN_CHUNK_TOKENS``
            tokens (the order does not depend on the backend, so pipeline stages agree on
            the rows of the hidden states they pass on); ``sample_idx``: batch rows that go
            through the lm_head, those of each ``sample_seqs`` sequence in order.
        """
        bs, dev = self.block_size, self.device

        # (stable; a speculating decode is a chunk of 1 + k tokens)
        keyed = sorted(((layout_key(len(s.token_ids) + len(s.spec_token_ids), s.start, quantized), s) for s in seqs),
                       key=lambda ks: ks[0])
        seqs = [s for _, s in keyed]
        rows = self.update(seqs)
        ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        sample_idx: list[int] = []
        sample_seqs = []
        prefills: list[PrefillChunk] = []
        num_native = 0
        for key, s in keyed:
            start, n = s.start, len(s.token_ids) + len(s.spec_token_ids)
            q_start = len(ids)
            ids += s.token_ids
            ids += s.spec_token_ids
            starts.append(start)
            counts.append(n)
            if n != 1:
                prefills.append(PrefillChunk(q_start, q_start + n, start,
                                             block_index(s.block_table[: -(-(start + n) // bs)], dev)))
            if native and (prefill_native or not key[1]):   # the native sequences: a prefix of the order
                num_native += 1
            if s.sample:
                sample_idx += range(len(ids) - 1 - len(s.spec_token_ids), len(ids))
                sample_seqs.append(s)
        num_decodes = len(seqs) - len(prefills)
        rows_t = torch.tensor(rows, dtype=torch.long)
        starts_t = torch.tensor(starts, dtype=torch.long)
        if num_decodes == len(seqs):
            positions, tok_rows, seq_lens = starts_t, rows_t, starts_t + 1
        else:
            counts_t = torch.tensor(counts, dtype=torch.long)
            seq_of_tok = torch.repeat_interleave(counts_t)                    # [T] sequence of each token
            offset = starts_t - (counts_t.cumsum(0) - counts_t)               # position - batch row
            positions = torch.arange(len(ids)) + offset[seq_of_tok]
            tok_rows = rows_t[seq_of_tok]
            seq_lens = starts_t + counts_t
        slots = self.block_table[tok_rows, positions // bs].long() * bs + positions % bs
        md = AttentionMetadata(slot_mapping=slots.to(dev), num_decode_tokens=num_decodes, prefills=prefills)
        if native:
            md.native = self._native(rows_t[:num_native], seq_lens[:num_native], counts[:num_native],
                                     max(s + c for s, c in zip(starts[:num_native], counts[:num_native]))
                                     if num_native else 0, seqs[:num_decodes] if cascade else [])
        elif num_decodes:
            self._decode_fields(md, seqs[:num_decodes], rows_t[:num_decodes], seq_lens[:num_decodes],
                                cascade, dtype)
        return torch.tensor(ids, dtype=torch.long, device=dev), positions.to(dev), md, sample_idx, sample_seqs

    def _native(self, rows: torch.Tensor, seq_lens: torch.Tensor, counts: list[int], longest: int,
                decodes: Sequence[SeqInput] = ()) -> NativeMetadata:
        """The native kernel's sequences (the first ``S`` of the step): ``query_start_loc``
        ``[S + 1]``, ``seq_lens`` ``[S]`` and ``block_tables`` ``[S, W]`` (W: the widest
        sequence's blocks, at least 1), all int32. ``decodes`` (the first sequences, when
        cascade groups are wanted): rows sharing a prefix of blocks form groups
        (:func:`cascade_groups`) whose prefix the kernel reads once for all members; their
        own tables and lengths then start after it."""
        dev, i32, s = self.device, torch.int32, rows.shape[0]
        qsl = torch.zeros(s + 1, dtype=i32)
        if s:
            torch.cumsum(torch.tensor(counts, dtype=i32), 0, out=qsl[1:])
        width = max(-(-longest // self.block_size), 1)
        groups = []
        if len(decodes) > 1:
            bs = self.block_size
            groups = cascade_groups([d.block_table[: (d.start + bs) // bs] for d in decodes],
                                    [d.start + 1 for d in decodes], bs)
        if not groups:
            tables = self.gather(rows, seq_lens, width) if s else torch.zeros(0, 1, dtype=i32)
            return NativeMetadata(sum(counts), qsl.to(dev), seq_lens.to(i32).to(dev), tables.to(dev))
        member, shift = _group_rows(groups, s)
        seq_lens = seq_lens - shift * self.block_size
        tables = self.gather(rows, seq_lens, width, shift)
        pw = max(len(shared) for _, shared in groups)
        nm = NativeMetadata(sum(counts), qsl.to(dev), seq_lens.to(i32).to(dev), tables.to(dev))
        nm.prefix_group = torch.tensor(member, dtype=i32, device=dev)
        nm.prefix_block_tables = torch.tensor([sh + [0] * (pw - len(sh)) for _, sh in groups], dtype=i32, device=dev)
        nm.prefix_lens = torch.tensor([len(sh) * self.block_size for _, sh in groups], dtype=i32, device=dev)
        return nm

    def _decode_fields(self, md: AttentionMetadata, seqs: list[SeqInput], rows: torch.Tensor,
                       lens: torch.Tensor, cascade: bool, dtype: torch.dtype) -> None:
        """The torch backend's decode fields of ``md`` (``seqs``: the decodes, their ``rows`` and
        ``lens`` ``[Bd]`` int64), with cascade groups when ``cascade``."""
        bs, dev = self.block_size, self.device
        if len(seqs) == 1:                 # one row: a view when its blocks are one contiguous run
            s = seqs[0]
            bt = block_index(s.block_table[: (s.start + bs) // bs], dev)
            bt = bt[None] if isinstance(bt, torch.Tensor) else bt
            set_decode_tensors(md, bt, lens.to(dev), (s.start + bs) // bs, bs, dtype)
            return
        width = (max(s.start for s in seqs) + bs) // bs
        shift = None
        if cascade:
            tables = [s.block_table[: (s.start + bs) // bs] for s in seqs]
            groups = cascade_groups(tables, [s.start + 1 for s in seqs], bs)
            if groups:
                md.cascade = [CascadeGroup(torch.tensor(g, dtype=torch.long, device=dev), block_index(shared, dev))
                              for g, shared in groups]
                shift = _group_rows(groups, len(seqs))[1]
                lens = lens - shift * bs
                width = max(len(t) for t in tables)          # the stripped tables
        bt = self.gather(rows, lens, width, shift)
        set_decode_tensors(md, bt.long().to(dev), lens.to(dev), width, bs, dtype)


def _group_rows(groups: list[tuple[list[int], list[int]]], n: int) -> tuple[list[int], torch.Tensor]:
    """For ``n`` rows and :func:`cascade_groups`' groups: each row's group (-1: none) and
    ``[n]`` int64 the blocks its table skips (its group's shared prefix; 0 outside a group)."""
    member, shifts = [-1] * n, [0] * n
    for g, (rows, shared) in enumerate(groups):
        for r in rows:
            member[r], shifts[r] = g, len(shared)
    return member, torch.tensor(shifts, dtype=torch.long)


def cascade_groups(tables: list[list[int]], lens: list[int], block_size: int) -> list[tuple[list[int], list[int]]]:
    """Group decode rows whose block tables start with the same physical blocks (at least
    ``CASCADE_MIN_BLOCKS``, at least 2 rows); strip the shared blocks from ``tables`` and
    ``lens`` in place so those rows attend to the shared prefix once, as a group. Returns
    (rows, shared block ids) per group.

    Rows are sorted by block table, so rows sharing long prefixes are neighbours; a group
    grows while the next row still shares at least half of the group's prefix (so a short
    prefix common to everyone, a system prompt, does not swallow the longer per-document
    prefixes)."""
    bs = block_size
    order = sorted((r for r in range(len(tables)) if len(tables[r]) > CASCADE_MIN_BLOCKS),
                   key=lambda r: tables[r])
    groups, cur, prefix = [], [], []

    def close():
        if len(cur) >= 2 and len(prefix) >= CASCADE_MIN_BLOCKS:
            groups.append((list(cur), list(prefix)))

    for r in order:
        own = tables[r][: (lens[r] - 1) // bs]     # a row's last block is its own
        if cur:
            n = 0
            limit = min(len(prefix), len(own))
            while n < limit and own[n] == prefix[n]:
                n += 1
            if n >= CASCADE_MIN_BLOCKS and 2 * n >= len(prefix):
                cur.append(r)
                prefix = prefix[:n]
                continue
            close()
        cur, prefix = [r], own
    close()
    for rows, shared in groups:
        for r in rows:
            tables[r] = tables[r][len(shared):]
            lens[r] -= len(shared) * bs
    return groups
