"""The persistent input batch (workers/input_batch.py): updated incrementally across steps, it
gives exactly the tensors of a batch built from scratch for each step, and those tensors are
the list-based formulas (positions, slot = table[pos // bs] * bs + pos % bs, zero-padded block
tables) the model runner used before."""

from __future__ import annotations

import random

import pytest
import torch

from workers.input_batch import STALE_STEPS, InputBatch, cascade_groups
from workers.layers.attention import SDPA_MIN_CHUNK_TOKENS
from workers.step import SeqInput

BS = 4


def _seq(rid, start, n, table, spec=(), sample=True):
    return SeqInput(rid, start, list(range(100, 100 + n)), list(table), sample, spec_token_ids=list(spec))


def _eq(a, b, what):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (what, a, b)
    else:
        assert a == b, (what, a, b)


def _same_step(a, b):
    """Two ``InputBatch.prepare`` results are equal field by field."""
    for i in (0, 1, 3):
        _eq(a[i], b[i], i)
    assert [s.request_id for s in a[4]] == [s.request_id for s in b[4]]
    ma, mb = a[2], b[2]
    for f in ("slot_mapping", "num_decode_tokens", "decode_block_tables", "decode_seq_lens", "decode_mask"):
        _eq(getattr(ma, f), getattr(mb, f), f)
    assert [(g.rows.tolist(), g.prefix_blocks) for g in ma.cascade] == [(g.rows.tolist(), g.prefix_blocks)
                                                                        for g in mb.cascade]
    assert len(ma.prefills) == len(mb.prefills)
    for p, q in zip(ma.prefills, mb.prefills):
        assert (p.q_start, p.q_end, p.ctx_len) == (q.q_start, q.q_end, q.ctx_len)
        _eq(p.block_table, q.block_table, "prefill table")
    assert (ma.native is None) == (mb.native is None)
    if ma.native is not None:
        for f in ("num_tokens", "query_start_loc", "seq_lens", "block_tables"):
            _eq(getattr(ma.native, f), getattr(mb.native, f), f)


def _padded(tables, dtype):
    width = max((len(t) for t in tables), default=1) or 1
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype).reshape(len(tables), width)


def _check_formulas(seqs, out, native, quantized, cascade):
    """``out`` against the per-token Python formulas of the list-based preparation."""
    def order(s):
        n = len(s.token_ids) + len(s.spec_token_ids)
        return n != 1, n != 1 and not quantized and (s.start == 0 or n >= SDPA_MIN_CHUNK_TOKENS)

    seqs = sorted(seqs, key=order)
    pos, slots = [], []
    for s in seqs:
        rng = range(s.start, s.start + len(s.token_ids) + len(s.spec_token_ids))
        pos += rng
        slots += [s.block_table[p // BS] * BS + p % BS for p in rng]
    _eq(out[1], torch.tensor(pos, dtype=torch.long), "positions")
    _eq(out[2].slot_mapping, torch.tensor(slots, dtype=torch.long), "slot mapping")
    dec = [s for s in seqs if len(s.token_ids) + len(s.spec_token_ids) == 1]
    tables = [s.block_table[: (s.start + BS) // BS] for s in dec]
    lens = [s.start + 1 for s in dec]
    md = out[2]
    if native:
        nat = [s for s in seqs if not order(s)[1]]
        kv = [s.start + len(s.token_ids) + len(s.spec_token_ids) for s in nat]
        _eq(md.native.seq_lens, torch.tensor(kv, dtype=torch.int32), "native seq_lens")
        _eq(md.native.block_tables, _padded([s.block_table[: -(-n // BS)] for s, n in zip(nat, kv)], torch.int32),
            "native block tables")
        qsl = [0]
        for s in nat:
            qsl.append(qsl[-1] + len(s.token_ids) + len(s.spec_token_ids))
        _eq(md.native.query_start_loc, torch.tensor(qsl, dtype=torch.int32), "query_start_loc")
    elif len(dec) > 1:
        groups = cascade_groups(tables, lens, BS) if cascade else []
        assert [g for g, _ in groups] == [g.rows.tolist() for g in md.cascade]
        _eq(md.decode_block_tables, _padded(tables, torch.long), "decode tables")
        _eq(md.decode_seq_lens, torch.tensor(lens, dtype=torch.long), "decode lens")


def _check_rows(batch: InputBatch):
    """Each live row holds its request's last table, zeros after; free rows are all zeros."""
    live = set(batch.row_of.values())
    for r in range(batch.num_rows):
        t = batch._stored[r] if r in live else []
        want = torch.zeros(batch.block_table.shape[1], dtype=torch.int32)
        want[: len(t)] = torch.tensor(t, dtype=torch.int32)
        _eq(batch.block_table[r], want, f"row {r}")
        assert int(batch.num_blocks[r]) == len(t)
    assert sorted(batch.free_rows + sorted(live)) == list(range(batch.num_rows))


@pytest.mark.parametrize("seed", range(4))
def test_incremental_updates_equal_a_rebuild_and_the_python_formulas(seed):
    """Random steps: new requests (some on a shared prefix, so cascade groups form), growing
    tables, decodes, chunks, speculative chunks, trimmed tails, preempted requests coming back
    with another table, removed requests, ids reused, more live requests than preallocated rows."""
    rng = random.Random(seed)
    backend = [(True, False, False), (True, True, False), (False, False, True), (False, True, False)][seed]
    native, quantized, cascade = backend
    batch = InputBatch(2, 3, BS)
    free, fresh = [], iter(range(1, 10 ** 6))
    shared = [next(fresh) for _ in range(6)]

    def block():
        return free.pop(rng.randrange(len(free))) if free and rng.random() < 0.7 else next(fresh)

    def release(table):
        free.extend(b for b in table if b not in shared)
    live: dict[str, tuple[int, list[int]]] = {}
    next_id, steps, rewrites = 0, 0, 0
    for _ in range(120):
        for _ in range(rng.randint(0, 3)):
            rid = f"r{rng.randrange(next_id + 1)}" if rng.random() < 0.2 else f"r{next_id}"
            next_id += 1
            if rid not in live:
                k = rng.randint(0, 6) if rng.random() < 0.6 else 0
                live[rid] = (k * BS, shared[:k])
        seqs = []
        for rid, (done, table) in list(live.items()):
            if rng.random() < 0.2:
                continue
            if done and rng.random() < 0.07:                 # preempted: recomputed on new blocks
                release(table)
                done, table, rewrites = 0, [], rewrites + 1
            n = 1 if done and rng.random() < 0.7 else rng.randint(1, 40)
            spec = [7] * rng.choice([0, 0, 2, 3])
            lookahead = rng.choice([0, 0, 4])
            need = -(-(done + n + len(spec) + lookahead) // BS)
            table = table + [block() for _ in range(need - len(table))]
            seqs.append(_seq(rid, done, n, table[:need], spec))
            keep = -(-(done + n) // BS)
            release(table[keep:])
            live[rid] = (done + n, table[:keep])      # blocks of rejected proposals / lookahead trimmed
        if not seqs:
            continue
        rng.shuffle(seqs)
        kw = dict(native=native, quantized=quantized, cascade=cascade, dtype=torch.float32)
        out = batch.prepare(seqs, **kw)
        _same_step(out, InputBatch(1, 1, BS).prepare(seqs, **kw))
        _check_formulas(seqs, out, native, quantized, cascade)
        _check_rows(batch)
        steps += 1
        ended = [r for r in live if rng.random() < 0.12 or live[r][0] > 160]
        for r in ended:
            release(live.pop(r)[1])
        batch.remove(ended)
    assert steps > 80 and rewrites > 3
    assert batch.num_rows > 2                 # grew past the preallocated rows


def test_only_new_blocks_are_written():
    """A running request's stored blocks are not rewritten when its table grows: a cell
    changed behind the batch's back stays changed (white-box check of the incremental write)."""
    batch = InputBatch(4, 8, BS)
    batch.update([_seq("a", 0, 5, [3, 9])])
    row = batch.row_of["a"]
    batch.block_table[row, 0] = 42
    batch.update([_seq("a", 5, 4, [3, 9, 11])])
    assert batch.block_table[row, :4].tolist() == [42, 9, 11, 0] and int(batch.num_blocks[row]) == 3


def test_preempted_request_and_reused_id_are_rewritten():
    batch = InputBatch(4, 8, BS)
    batch.update([_seq("a", 0, 12, [3, 4, 5])])
    row = batch.row_of["a"]
    batch.update([_seq("a", 0, 6, [7, 8])])                  # preempted, back on other blocks
    assert batch.block_table[row].tolist()[:4] == [7, 8, 0, 0] and int(batch.num_blocks[row]) == 2
    batch.update([_seq("a", 0, 9, [7, 6, 2])])               # same length prefix, different middle
    assert batch.block_table[row].tolist()[:4] == [7, 6, 2, 0]
    batch.remove(["a"])
    assert batch.block_table[row].tolist() == [0] * 8 and row in batch.free_rows
    rows = batch.update([_seq("b", 0, 2, [1]), _seq("a", 0, 2, [9])])   # the id comes back as a new request
    assert batch.block_table[rows[1], :2].tolist() == [9, 0] and rows[0] == row


def test_rows_and_columns_grow_and_stale_rows_are_reclaimed():
    batch = InputBatch(2, 2, BS)
    seqs = [_seq(f"r{i}", 0, 3 + 4 * i, list(range(10 * i + 1, 10 * i + 2 + i))) for i in range(5)]
    rows = batch.update(seqs)
    assert len(set(rows)) == 5 and batch.num_rows >= 5 and batch.block_table.shape[1] >= 5
    for s, r in zip(seqs, rows):
        assert batch.block_table[r, : len(s.block_table)].tolist() == s.block_table
    n = batch.num_rows
    # never removed (a path that skips free_requests): their rows go back once stale
    for i in range(STALE_STEPS + 1):
        batch.update([_seq("x", i, 1, [99] * (i // BS + 1))])
    for i in range(n - 1):         # with "x", as many live requests as rows
        batch.update([_seq("x", STALE_STEPS + 1 + i, 1, [99] * 20), _seq(f"new{i}", 0, 1, [5])])
    assert batch.num_rows == n
    assert not any(f"r{i}" in batch.row_of for i in range(5))
    _check_rows(batch)


def test_single_decode_of_a_contiguous_run_is_a_slice():
    """The torch path keeps reading one decode row over consecutive blocks as a view."""
    batch = InputBatch(2, 8, BS)
    md = batch.prepare([_seq("a", 9, 1, [4, 5, 6])], native=False, quantized=False, cascade=True,
                       dtype=torch.float32)[2]
    assert md.decode_block_tables == slice(4, 7)
    assert md.decode_mask.shape == (1, 1, 1, 3 * BS) and md.slot_mapping.tolist() == [6 * BS + 1]
