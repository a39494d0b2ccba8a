"""Turns a :class:`scheduler.scheduler.SchedulerOutput` into tensors, runs the model over the
paged KV cache and samples the next tokens.

Batch layout (see :mod:`workers.layers.attention`): single-token decodes first, then prefill
chunks. Only the last position of each sequence that completes its scheduled tokens goes
through the lm_head and the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.config import EngineConfig
from scheduler.scheduler import SchedulerOutput
from workers.kv_cache import allocate_kv_cache, budget_bytes, bytes_per_block, kv_dtype
from workers.layers.attention import AttentionMetadata, CascadeGroup, PrefillChunk, block_index
from workers.layers.sampler import Sampler, SamplingMetadata, make_generator
from workers.loader import load_model

CASCADE_MIN_BLOCKS = 4   # shorter shared prefixes are not worth a separate pass


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]                       # request id -> new token id
    logprobs: dict[str, dict[int, float]] | None  # request id -> {token id: logprob}


class ModelRunner:
    """Holds the model weights, the KV cache and the sampler of one process.

    Args:
        cfg: engine settings (model path, dtypes, block size, KV memory budget, device).
        model_dir: resolved checkpoint directory.
        num_blocks: size of the KV pool; None sizes it from ``cfg.kv_cache_memory``.
    Raises:
        EngineError: the checkpoint cannot be served, or the KV budget holds no block.
    """

    def __init__(self, cfg: EngineConfig, model_dir: str, num_blocks: int | None = None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        self.model = load_model(model_dir, dtype=self.dtype, device=self.device, max_positions=cfg.max_model_len)
        m = self.model.cfg
        self.vocab_size = m.vocab_size
        self.block_size = cfg.block_size
        self.kv_dtype = kv_dtype(cfg.kv_cache_dtype, self.dtype)
        per_block = bytes_per_block(m.num_layers, cfg.block_size, m.num_kv_heads, m.head_dim, self.kv_dtype)
        if num_blocks is None:
            num_blocks = budget_bytes(cfg.kv_cache_memory, self.device) // per_block
        if num_blocks < 1:
            from scheduler.request import EngineError
            raise EngineError(f"KV cache budget {budget_bytes(cfg.kv_cache_memory, self.device)} bytes "
                              f"holds no block of {per_block} bytes; raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.kv_cache_bytes = num_blocks * per_block
        self.kv_caches = allocate_kv_cache(len(self.model.layers), num_blocks, cfg.block_size,
                                           m.num_kv_heads, m.head_dim, self.kv_dtype, self.device)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    # ---- input preparation -----------------------------------------------------------
    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        seqs = sorted(out.seqs, key=lambda s: s.num_new_tokens != 1)     # decodes first (stable)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        sample_seqs = []
        decode_tables, decode_lens = [], []
        prefills: list[PrefillChunk] = []
        for s in seqs:
            req, start, n = s.req, s.start, s.num_new_tokens
            bt = req.block_table
            q_start = len(ids)
            ids += req.tokens(start, start + n)
            pos += range(start, start + n)
            slots += [bt[p // bs] * bs + p % bs for p in range(start, start + n)]
            if n == 1:
                decode_tables.append(bt[: (start + bs) // bs])
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillChunk(q_start, q_start + n, start,
                                             block_index(bt[: -(-(start + n) // bs)], self.device)))
            if s.sample:
                sample_idx.append(len(ids) - 1)
                sample_seqs.append(s)
        dev = self.device
        md = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                               num_decode_tokens=len(decode_lens), prefills=prefills)
        if decode_lens:
            if self.cfg.enable_prefix_caching:
                md.cascade = self._cascade_groups(decode_tables, decode_lens)
            width = max(len(t) for t in decode_tables)
            if len(decode_tables) == 1:
                md.decode_block_tables = block_index(decode_tables[0], dev)
                if isinstance(md.decode_block_tables, torch.Tensor):
                    md.decode_block_tables = md.decode_block_tables[None]
            else:
                md.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                                                      dtype=torch.long, device=dev)
            md.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
            valid = torch.arange(width * bs, device=dev)[None, :] < md.decode_seq_lens[:, None]
            md.decode_mask = torch.zeros(valid.shape, dtype=self.dtype, device=dev).masked_fill_(
                ~valid, float("-inf"))[:, None, None, :]
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                md, sample_idx, sample_seqs)

    def _cascade_groups(self, tables: list[list[int]], lens: list[int]) -> list[CascadeGroup]:
        """Group decode rows whose block tables start with the same physical blocks (at least
        ``CASCADE_MIN_BLOCKS``, at least 2 rows); strip the shared blocks from ``tables`` and
        ``lens`` in place so those rows attend to the shared prefix once, as a group.

        Rows are sorted by block table, so rows sharing long prefixes are neighbours; a group
        grows while the next row still shares at least half of the group's prefix (so a short
        prefix common to everyone, a system prompt, does not swallow the longer per-document
        prefixes)."""
        bs = self.block_size
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
        out = []
        for rows, shared in groups:
            out.append(CascadeGroup(torch.tensor(rows, dtype=torch.long, device=self.device),
                                    block_index(shared, self.device)))
            for r in rows:
                tables[r] = tables[r][len(shared):]
                lens[r] -= len(shared) * bs
        return out

    def _generator(self, req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        g = self.generators.get(req.request_id)
        if g is None:
            g = self.generators[req.request_id] = make_generator(seed, self.device)
        return g

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: K/V of every scheduled token into the cache, one token sampled per
        sequence whose chunk ends at its last token."""
        input_ids, positions, md, sample_idx, sample_seqs = self._prepare(out)
        hidden = self.model(input_ids, positions, md, self.kv_caches)
        if not sample_idx:
            return ModelRunnerOutput({}, None)
        logits = self.model.compute_logits(hidden[sample_idx])
        reqs = [s.req for s in sample_seqs]
        self._suppress_stops(logits, reqs)
        smd = SamplingMetadata.build([r.sampling_params for r in reqs],
                                     [r.prompt_token_ids for r in reqs], [r.output_token_ids for r in reqs],
                                     [self._generator(r) for r in reqs], self.vocab_size, self.device)
        so = self.sampler(logits, smd)
        tokens = so.token_ids.tolist()
        sampled = {r.request_id: t for r, t in zip(reqs, tokens)}
        logprobs = None
        if so.logprobs is not None:
            logprobs = {r.request_id: lp for r, lp in zip(reqs, so.logprobs) if r.sampling_params.logprobs is not None}
        return ModelRunnerOutput(sampled, logprobs)

    @staticmethod
    def _suppress_stops(logits: torch.Tensor, reqs) -> None:
        """``min_tokens``: while a request has fewer output tokens, its EOS and stop token ids
        cannot be sampled (their logits become -inf), as in vLLM."""
        for row, r in enumerate(reqs):
            sp = r.sampling_params
            if r.num_output_tokens < sp.min_tokens:
                ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(r.eos_token_ids))
                if ids:
                    logits[row, ids] = float("-inf")

    def free_requests(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators) of finished requests."""
        for rid in request_ids:
            self.generators.pop(rid, None)
