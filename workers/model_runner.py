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
from scheduler.request import SamplingParams
from scheduler.scheduler import SchedulerOutput
from workers.kv_cache import allocate_kv_cache, budget_bytes, bytes_per_block, kv_dtype
from workers.layers.attention import AttentionMetadata, CascadeGroup, PrefillChunk, block_index
from workers.layers.sampler import Sampler, SamplingMetadata, make_generator
from workers.loader import load_model

CASCADE_MIN_BLOCKS = 4   # shorter shared prefixes are not worth a separate pass


@dataclass
class SeqInput:
    """One sequence of a step, as the workers see it (no scheduler state: it crosses process
    boundaries to pipeline stages). Token ids are Python ints; positions count from 0.

    ``token_ids`` are the tokens at positions ``[start, start + len(token_ids))``;
    ``block_table`` lists the KV blocks covering positions ``[0, start + len(token_ids))``.
    The sampling fields are set only when ``sample`` (the chunk ends at the last token);
    ``prompt_token_ids`` / ``output_token_ids`` only when a penalty needs the history.
    ``traceparent``: the W3C trace context of the scheduler's span of a traced request (None
    when tracing is off); the workers' spans of the request are its children.
    """

    request_id: str
    start: int
    token_ids: list[int]
    block_table: list[int]
    sample: bool
    params: SamplingParams | None = None
    num_output_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    traceparent: str | None = None


@dataclass
class StepInput:
    """What one model step computes: the scheduled sequences (any order)."""

    seqs: list[SeqInput]

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput, block_size: int) -> "StepInput":
        seqs = []
        for s in out.seqs:
            req, end = s.req, s.start + s.num_new_tokens
            seq = SeqInput(req.request_id, s.start, req.tokens(s.start, end),
                           req.block_table[: -(-end // block_size)], s.sample, traceparent=req.traceparent)
            if s.sample:
                sp = seq.params = req.sampling_params
                seq.num_output_tokens, seq.eos_token_ids = req.num_output_tokens, req.eos_token_ids
                if sp.repetition_penalty != 1.0:
                    seq.prompt_token_ids = req.prompt_token_ids
                if sp.repetition_penalty != 1.0 or sp.presence_penalty or sp.frequency_penalty:
                    seq.output_token_ids = req.output_token_ids
            seqs.append(seq)
        return cls(seqs)


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]                       # request id -> new token id
    logprobs: dict[str, dict[int, float]] | None  # request id -> {token id: logprob}


class ModelRunner:
    """Holds the model weights (all layers, or one pipeline stage's), their KV cache and, on
    the last stage, the sampler.

    Args:
        cfg: engine settings (model path, dtypes, block size, KV memory budget, device).
        model_dir: resolved checkpoint directory.
        num_blocks: size of the KV pool; None sizes it from ``cfg.kv_cache_memory``. The
            pool is counted in blocks of the whole model, so every stage of a pipeline
            gets the same number of blocks (and the same block ids) from one budget.
        start_layer, end_layer: the decoder layers this runner holds (default: all).
    Raises:
        EngineError: the checkpoint cannot be served, or the KV budget holds no block.
    """

    def __init__(self, cfg: EngineConfig, model_dir: str, num_blocks: int | None = None,
                 start_layer: int = 0, end_layer: int | None = None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype
        self.model = load_model(model_dir, dtype=self.dtype, device=self.device, max_positions=cfg.max_model_len,
                                start_layer=start_layer, end_layer=end_layer)
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
        stage_layers = len(self.model.layers)
        self.kv_cache_bytes = num_blocks * per_block * stage_layers // m.num_layers
        self.kv_caches = allocate_kv_cache(len(self.model.layers), num_blocks, cfg.block_size,
                                           m.num_kv_heads, m.head_dim, self.kv_dtype, self.device)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    # ---- input preparation -----------------------------------------------------------
    def _prepare(self, step: StepInput):
        bs = self.block_size
        seqs = sorted(step.seqs, key=lambda s: len(s.token_ids) != 1)     # decodes first (stable)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        sample_seqs = []
        decode_tables, decode_lens = [], []
        prefills: list[PrefillChunk] = []
        for s in seqs:
            start, n, bt = s.start, len(s.token_ids), s.block_table
            q_start = len(ids)
            ids += s.token_ids
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

    def _generator(self, s: SeqInput) -> torch.Generator | None:
        seed = s.params.seed
        if seed is None:
            return None
        g = self.generators.get(s.request_id)
        if g is None:
            g = self.generators[s.request_id] = make_generator(seed, self.device)
        return g

    # ---- one step ----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput, hidden: torch.Tensor | None = None) -> ModelRunnerOutput | torch.Tensor:
        """Run one step through this runner's layers: K/V of every scheduled token into the
        cache. The first stage takes token ids from ``step``; later stages take ``hidden``
        (``[T, hidden_size]``, the previous stage's output, tokens in ``_prepare``'s order).
        A stage that is not the last returns its hidden states; the last samples one token
        per sequence whose chunk ends at its last token and returns a ModelRunnerOutput."""
        input_ids, positions, md, sample_idx, sample_seqs = self._prepare(step)
        hidden = self.model(input_ids if hidden is None else hidden, positions, md, self.kv_caches)
        if not self.model.is_last:
            return hidden
        if not sample_idx:
            return ModelRunnerOutput({}, None)
        logits = self.model.compute_logits(hidden[sample_idx])
        self._suppress_stops(logits, sample_seqs)
        smd = SamplingMetadata.build([s.params for s in sample_seqs],
                                     [s.prompt_token_ids or [] for s in sample_seqs],
                                     [s.output_token_ids or [] for s in sample_seqs],
                                     [self._generator(s) for s in sample_seqs], self.vocab_size, self.device)
        so = self.sampler(logits, smd)
        tokens = so.token_ids.tolist()
        sampled = {s.request_id: t for s, t in zip(sample_seqs, tokens)}
        logprobs = None
        if so.logprobs is not None:
            logprobs = {s.request_id: lp for s, lp in zip(sample_seqs, so.logprobs) if s.params.logprobs is not None}
        return ModelRunnerOutput(sampled, logprobs)

    @staticmethod
    def _suppress_stops(logits: torch.Tensor, seqs: list[SeqInput]) -> None:
        """``min_tokens``: while a request has fewer output tokens, its EOS and stop token ids
        cannot be sampled (their logits become -inf), as in vLLM."""
        for row, s in enumerate(seqs):
            sp = s.params
            if s.num_output_tokens < sp.min_tokens:
                ids = list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(s.eos_token_ids))
                if ids:
                    logits[row, ids] = float("-inf")

    def free_requests(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators) of finished requests."""
        for rid in request_ids:
            self.generators.pop(rid, None)
