"""Turns a step (:class:`workers.step.StepInput`) into tensors, runs the model over the paged KV
cache and samples the next tokens.

Batch layout (see :mod:`workers.layers.attention`): single-token decodes first, then prefill
chunks. Only the last position of each sequence that completes its scheduled tokens goes
through the lm_head and the sampler.

Speculative decoding (docs/spec_decode.md): a sequence with proposals (``spec_token_ids``)
runs its last token and the ``k`` proposals as a ``1 + k``-token chunk after its cached
context (the prefill path), and all ``1 + k`` positions go through the lm_head and the
verifier (:mod:`workers.spec_decode.rejection`). The last stage then proposes the next step's
tokens of each sequence that asks (``num_proposals``) with the engine's proposers: prompt
lookup over the sequence's prompt and output (:mod:`workers.spec_decode.ngram`), the draft
model (:mod:`workers.spec_decode.draft`, run over every sequence of the step so that it writes
the K/V it will read), or both (the lookup where it matches, the draft elsewhere), and returns
the proposals with the step's output.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvmesh.core.engine_config import LOOKUP_METHODS, EngineConfig
from kvmesh.core.errors import SettingsError
from kvmesh.core.sampling import SamplingParams
from workers.kv_cache import allocate_kv_cache, budget_bytes, bytes_per_block, kv_dtype
from workers.input_batch import InputBatch
from workers.layers.sampler import SAMPLING_EPS, Sampler, SamplingMetadata, make_generator, processed_probs
from workers.loader import load_model, use_serving_kernels, weight_bytes
from workers.spec_decode.ngram import propose_ngram
from workers.spec_decode.rejection import VerifyRow, verify
from workers.step import SeqInput, StepInput
from workers.tensor_parallel import TensorParallel

log = logging.getLogger("kvmesh.workers")


def resolve_attention_backend(cfg: EngineConfig, device: torch.device, head_dim: int) -> str:
    """``native`` or ``torch`` for ``cfg.attention_backend``. ``auto`` picks native when the
    kernels are built and run on this device, else torch with a log line saying why.
    Raises EngineError when ``native`` was asked for and cannot run."""
    if cfg.attention_backend == "torch":
        return "torch"
    if device.type != "cpu":
        reason = f"the native kernels are CPU kernels (device {device})"
    elif head_dim % 8:
        reason = f"head_dim {head_dim} is not a multiple of 8"
    else:
        from workers import kernels
        reason = None if kernels.available() else kernels.unavailable_reason()
    if reason is None:
        return "native"
    if cfg.attention_backend == "native":
        raise SettingsError(f"attention_backend native cannot run: {reason}")
    log.warning("kvmesh: attention backend torch (the PyTorch reference): %s", reason)
    return "torch"


def apply_kernel_isa(cfg: EngineConfig, device: torch.device) -> None:
    """Set the native kernels' level to ``cfg.kernel_isa`` (:func:`workers.kernels.set_isa`:
    process-wide; a level above the CPU's is lowered, with a warning) when this engine runs on
    the CPU and the kernels load; nothing otherwise."""
    if device.type != "cpu":
        return
    from workers import kernels
    if kernels.available():
        kernels.set_isa(cfg.kernel_isa)


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy, no penalties, no logprobs: the next token is the logits' argmax."""
    return p.temperature < SAMPLING_EPS and p.logprobs is None and not p.has_penalties


@dataclass
class ModelRunnerOutput:
    """``sampled``: request id -> its new tokens (accepted proposals, then the target's own
    token; one token without speculation). ``logprobs``: request id -> {token id: logprob}
    of its one new token (speculating requests never ask). ``proposals``: the proposals for
    each asking request's next step (none where no proposer had any); ``propose_seconds``: time
    the proposers took."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, dict[int, float]] | None
    proposals: dict[str, list[int]] = field(default_factory=dict)
    propose_seconds: float = 0.0


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
        tp: this runner's tensor-parallel rank (:mod:`workers.tensor_parallel`; None: the
            whole of each layer). Each rank holds its heads' part of every KV block (the block
            ids are the replica's); on the last stage every rank computes its token ids' logits
            and rank 0 alone samples and runs the proposers (:attr:`samples`).
    Raises:
        EngineError: the checkpoint cannot be served, or the KV budget holds no block.
    """

    def __init__(self, cfg: EngineConfig, model_dir: str, num_blocks: int | None = None,
                 start_layer: int = 0, end_layer: int | None = None, tp: TensorParallel | None = None):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        apply_kernel_isa(cfg, self.device)            # before the weights: their packing follows the level
        self.dtype = cfg.torch_dtype
        self.model = load_model(model_dir, dtype=self.dtype, device=self.device, max_positions=cfg.max_model_len,
                                start_layer=start_layer, end_layer=end_layer, weight_format=cfg.weight_format,
                                group_size=cfg.quant_group_size, calibration=cfg.enable_calibration,
                                calibration_data=cfg.calibration_data, tp=tp)
        # native GEMM / fused ops, bound Linear arguments (oneDNN's float32 weights are opaque to torch.compile)
        use_serving_kernels(self.model, self.dtype, self.device, onednn=not cfg.enable_compile)
        self.weight_bytes = weight_bytes(self.model)   # stored weights incl. scales/zeros (bytes)
        m = self.model.cfg
        self.vocab_size = m.vocab_size
        self.block_size = cfg.block_size
        self.kv_dtype = kv_dtype(cfg.kv_cache_dtype, self.dtype)
        per_block = bytes_per_block(m.num_layers, cfg.block_size, m.num_kv_heads, m.head_dim, self.kv_dtype)
        if num_blocks is None:
            num_blocks = budget_bytes(cfg.kv_cache_memory, self.device) // per_block
        if num_blocks < 1:
            raise SettingsError(f"KV cache budget {budget_bytes(cfg.kv_cache_memory, self.device)} bytes "
                                f"holds no block of {per_block} bytes; raise --kv-cache-memory")
        self.num_blocks = num_blocks
        stage_layers = len(self.model.layers)
        plan = self.model.plan
        self.kv_cache_bytes = num_blocks * per_block * stage_layers * plan.num_kv_heads // (m.num_layers * m.num_kv_heads)
        self.kv_caches = allocate_kv_cache(len(self.model.layers), num_blocks, cfg.block_size,
                                           plan.num_kv_heads, m.head_dim, self.kv_dtype, self.device)
        # the runner that samples: the last stage's (its rank 0's under tensor parallelism)
        self.samples = self.model.is_last and plan.rank == 0
        self.attention_backend = resolve_attention_backend(cfg, self.device, m.head_dim)
        # prefill chunks through the kernel too where it beats SDPA (its flash path on AMX or
        # AVX512-BF16: a bfloat16 cache, or an int8 / float8 one, whose chunks go through the
        # kernel in any case)
        self.prefill_native = False
        self.quantized_kv = bool(self.kv_caches) and self.kv_caches[0].quantized
        if self.attention_backend == "native" and (self.kv_dtype == self.dtype or self.quantized_kv):
            from workers import kernels
            self.prefill_native = kernels.prefill_in_kernel(self.dtype)
        # Cascade groups on the native backend only where a group's rows run the flash path (AMX
        # or AVX512-BF16 register tiles), where they measured faster than plain rows; through the
        # float32 many-row path a group's prefix read once, then a merge, measured slower than each
        # row reading its whole context (figures: docs/engine.md, "Attention backends" and
        # "Profile", 2026-12-02 on a Zen 5).
        self.native_cascade = self.prefill_native
        self.compiled_decode = None
        if cfg.enable_compile and plan.size > 1:
            log.warning("kvmesh: enable_compile is off under tensor parallelism (its all-reduces are not compiled)")
        if cfg.enable_compile and self.attention_backend == "native" and plan.size == 1:
            from workers.compiled_decode import CompiledDecode
            self.compiled_decode = CompiledDecode(self.model, self.kv_caches, cfg.max_num_seqs,
                                                  -(-cfg.max_model_len // cfg.block_size), self.device)
            self.compiled_decode.warmup(self.model.is_first, self.dtype)
        # block tables, positions and slots of each step (rows per request, updated in place)
        self.input_batch = InputBatch(cfg.max_num_seqs, -(-(cfg.max_model_len or 8192) // cfg.block_size),
                                      cfg.block_size, self.device)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        # prompt lookup answers a step's asks for proposals under 'ngram' and 'ngram+draft', and on
        # any runner without a draft model (the one proposer it has)
        self.lookup = self.samples and (cfg.speculative_method in LOOKUP_METHODS or not cfg.uses_draft)
        self.proposer = None           # the draft model (last stage, speculative_method 'draft' / 'ngram+draft')
        self.draft_probs: dict[str, tuple[list[int], torch.Tensor]] = {}   # id -> last proposal, its q
        if cfg.uses_draft and self.samples:
            from workers.spec_decode.draft import DraftProposer
            self.proposer = DraftProposer(cfg, num_blocks, cfg.block_size, self.device, self.attention_backend,
                                          self.prefill_native)

    # ---- input preparation -----------------------------------------------------------
    def _prepare(self, step: StepInput):
        """The step's tensors from the persistent input batch (:meth:`InputBatch.prepare`)."""
        native = self.attention_backend == "native"
        return self.input_batch.prepare(step.seqs, native=native,
                                        quantized=self.quantized_kv,
                                        cascade=self.cfg.enable_prefix_caching and (not native or self.native_cascade),
                                        dtype=self.dtype,
                                        prefill_native=self.prefill_native)

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
    def execute(self, step: StepInput, hidden: torch.Tensor | Callable[[], torch.Tensor] | None = None
                ) -> ModelRunnerOutput | torch.Tensor:
        """Run one step through this runner's layers: K/V of every scheduled token into the
        cache. The first stage takes token ids from ``step``; later stages take ``hidden``
        (``[T, hidden_size]``, the previous stage's output, tokens in ``_prepare``'s order), or
        a function returning it, called once the step's inputs are prepared (a pipeline stage
        prepares while the previous stage still computes).
        A stage that is not the last returns its hidden states; the last samples one token
        per sequence whose chunk ends at its last token and returns a ModelRunnerOutput (an
        empty one on a tensor-parallel rank other than 0)."""
        with torch.profiler.record_function("prepare"):
            input_ids, positions, md, sample_idx, sample_seqs = self._prepare(step)
        if callable(hidden):
            hidden = hidden()
        x = input_ids if hidden is None else hidden
        with torch.profiler.record_function("forward"):
            hidden = None
            if self.compiled_decode is not None and self.compiled_decode.accepts(md, x.shape[0]):
                hidden = self.compiled_decode.run_or_none(x, positions, md)
            if hidden is None:
                hidden = self.model(x, positions, md, self.kv_caches)
        if not self.model.is_last:
            return hidden
        if not self.samples:               # a tensor-parallel rank > 0: its logits go to rank 0
            if sample_idx:
                self.model.compute_logits(hidden[sample_idx])
            return ModelRunnerOutput({}, None)
        with torch.profiler.record_function("sample"):
            out = self._sample(hidden, sample_idx, sample_seqs)
        if self.proposer is not None or (self.lookup and any(s.num_proposals for s in step.seqs)):
            with torch.profiler.record_function("propose"):
                self._propose(step, out)
        return out

    def _sample(self, hidden: torch.Tensor, sample_idx: list[int], sample_seqs: list[SeqInput]) -> ModelRunnerOutput:
        """lm_head over the sampled positions, then sampling or speculative verification."""
        sampled: dict[str, list[int]] = {}
        logprobs = None
        if sample_idx:
            logits = self.model.compute_logits(hidden[sample_idx])
            rows, plain, spec = 0, [], []          # logits rows of plain and speculating sequences
            for s in sample_seqs:
                k = len(s.spec_token_ids)
                (spec if k else plain).append((s, range(rows, rows + k + 1)))
                rows += k + 1
            if plain:
                seqs = [s for s, _ in plain]
                pl = logits if not spec else logits[[r[0] for _, r in plain]]
                self._suppress_stops(pl, seqs)
                if all(_plain_greedy(s.params) for s in seqs):
                    # all-greedy fast path: one argmax, no sampling metadata tensors
                    sampled = {s.request_id: [t] for s, t in zip(seqs, pl.argmax(dim=-1).tolist())}
                    seqs = []
            if plain and seqs:
                smd = SamplingMetadata.build([s.params for s in seqs], [s.prompt_token_ids or [] for s in seqs],
                                             [s.output_token_ids or [] for s in seqs],
                                             [self._generator(s) for s in seqs], self.vocab_size, self.device)
                so = self.sampler(pl, smd)
                sampled |= {s.request_id: [t] for s, t in zip(seqs, so.token_ids.tolist())}
                if so.logprobs is not None:
                    logprobs = {s.request_id: lp for s, lp in zip(seqs, so.logprobs) if s.params.logprobs is not None}
            if spec:
                with torch.profiler.record_function("verify"):     # rejection: workers/spec_decode/rejection.py
                    sampled.update(self._verify([s for s, _ in spec], logits[[i for _, r in spec for i in r]]))
        return ModelRunnerOutput(sampled, logprobs)

    def _verify(self, seqs: list[SeqInput], logits: torch.Tensor) -> dict[str, list[int]]:
        """New tokens of the speculating sequences. ``logits``: ``[Σ (1 + k), V]``, each
        sequence's ``1 + k`` positions in order. Their requests have no penalties, logprobs or
        pending ``min_tokens`` (the scheduler does not speculate for them)."""
        logits = logits.float()
        greedy = [s.params.temperature < SAMPLING_EPS for s in seqs]
        probs = None
        if not all(greedy):
            params = [s.params for s in seqs for _ in range(len(s.spec_token_ids) + 1)]
            n = len(params)
            md = SamplingMetadata.build(params, [[]] * n, [[]] * n, [None] * n, self.vocab_size, self.device)
            probs = processed_probs(logits, md)
        rows = [VerifyRow(s.spec_token_ids, None if g else self._stored_draft_probs(s), g,
                          None if g else self._generator(s)) for s, g in zip(seqs, greedy)]
        return {s.request_id: toks for s, toks in zip(seqs, verify(rows, logits.argmax(dim=-1), probs))}

    def _stored_draft_probs(self, s: SeqInput) -> torch.Tensor | None:
        """The draft's ``[k, V]`` probabilities of the proposals being verified, when they
        are (a prefix of) the draft's last proposal for the request; None: a point mass."""
        stored = self.draft_probs.pop(s.request_id, None)
        k = len(s.spec_token_ids)
        if stored is None or stored[0][:k] != s.spec_token_ids:
            return None
        return stored[1][:k]

    def _propose(self, step: StepInput, out: ModelRunnerOutput) -> None:
        """The next step's proposals of the sequences that ask (``num_proposals``) into
        ``out.proposals``: prompt lookup over the sequence's prompt, output and new tokens; then
        the draft (when there is one) over every sequence of the step: it writes K/V for the
        tokens the target committed (the chunk, the accepted proposals and, for a sequence asking
        it for proposals, the new token) and proposes where the lookup found nothing."""
        t0 = time.perf_counter()
        looked_up: set[str] = set()
        if self.lookup:
            for s in step.seqs:
                new = out.sampled.get(s.request_id) if s.num_proposals else None
                if new:
                    found = propose_ngram(s.prompt_token_ids + s.output_token_ids + new, s.num_proposals,
                                          self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min)
                    if found:
                        out.proposals[s.request_id] = found
                        looked_up.add(s.request_id)
                        self.draft_probs.pop(s.request_id, None)     # a point mass, not the draft's q
        if self.proposer is not None:
            self._propose_draft(step, out, looked_up)
        out.propose_seconds = time.perf_counter() - t0

    def _propose_draft(self, step: StepInput, out: ModelRunnerOutput, looked_up: set[str]) -> None:
        """The draft over every sequence of the step; it proposes for the asking sequences not in
        ``looked_up`` (which then keep their lookup's proposals, and the draft K/V it did not
        write this step stays for the draft to catch up on)."""
        from workers.spec_decode.draft import DraftInput
        inputs = []
        for s in step.seqs:
            toks, m, params, gen = list(s.token_ids), 0, None, None
            if s.sample:
                new = out.sampled.get(s.request_id, [])
                toks += new[:-1]                       # accepted proposals
                params = s.params
                if s.num_proposals and new and s.request_id not in looked_up:
                    toks.append(new[-1])
                    m = s.num_proposals
                    gen = self._generator(s)
            inputs.append(DraftInput(s.request_id, s.start, toks, s.block_table, m, params, gen,
                                     s.prompt_token_ids))
        for rid, p in self.proposer.propose(inputs).items():
            if p.token_ids:
                out.proposals[rid] = list(p.token_ids)
                if p.probs is not None:
                    self.draft_probs[rid] = (list(p.token_ids), p.probs)

    @staticmethod
    def _suppress_stops(logits: torch.Tensor, seqs: list[SeqInput]) -> None:
        """``min_tokens``: while a request has fewer output tokens, its EOS and stop token ids
        cannot be sampled (their logits become -inf), as in vLLM. Stop token ids outside the
        logits (the vocabulary) are skipped: they can never be sampled, and a client may send any
        (indexing with one would kill the engine loop)."""
        vocab = logits.shape[-1]
        for row, s in enumerate(seqs):
            sp = s.params
            if s.num_output_tokens < sp.min_tokens:
                ids = [t for t in sp.stop_token_ids if t < vocab] + ([] if sp.ignore_eos else list(s.eos_token_ids))
                if ids:
                    logits[row, ids] = float("-inf")

    def free_requests(self, request_ids: list[str]) -> None:
        """Forget per-request state (input batch rows, seeded generators) of finished requests."""
        self.input_batch.remove(request_ids)
        for rid in request_ids:
            self.generators.pop(rid, None)
            self.draft_probs.pop(rid, None)
        if self.proposer is not None:
            self.proposer.free_requests(request_ids)
