"""Tensor parallelism: which part of every weight a rank holds, and the sums that join the parts.

Megatron-LM's split of a transformer block (Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3), as vLLM and SGLang
serve it: ``size`` ranks each hold

- **column-parallel** (output rows split): q/k/v (whole attention heads and KV heads: rank r
  holds heads ``[r H / tp, (r + 1) H / tp)`` and KV heads likewise, so each rank's attention
  runs on its own heads and its own heads' KV cache) and gate/up (a range of the MLP's
  intermediate columns);
- **row-parallel** (input columns split): o_proj (the rank's heads' columns) and down_proj (its
  intermediate range), each followed by one all-reduce (the sum of the ranks' partial outputs);
  a row-parallel bias is added once, by rank 0;
- **vocab-parallel** lm_head: rank r computes the logits of its range of token ids, and the
  ranks' logits are gathered (:meth:`TensorParallel.gather_logits`): the lm_head is the
  largest single matrix of a small model (Qwen2.5-1.5B: 15% of its bytes), so it is split like
  the rest rather than read whole by one rank while the others wait.
- **replicated**: the token embedding (a step reads only its T rows) and the norms.

Ranges along dimensions a quantization block spans (the intermediate size, the vocabulary) are
cut at multiples of :data:`ALIGN` where the size allows (256: a GGUF k-quant super-block, so the
published weights split without re-quantizing); earlier ranks take the remainder. Head counts
must divide by ``size`` (:func:`check_divisible`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvmesh.core.errors import EngineError, SettingsError

ALIGN = 256      # values: the largest GGUF block along K (QK_K super-blocks of Q4_K/Q5_K/Q6_K)
VOCAB_ALIGN = 16  # token ids: the gguf_linear kernel's output panels


def split_range(n: int, size: int, rank: int, align: int = 1) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank`` of ``size`` over ``n`` items, cut at multiples of
    ``align`` when ``n`` is one (else of 1), earlier ranks taking the remainder.

    Raises:
        SettingsError: fewer units than ranks (a rank would hold nothing)."""
    unit = align if n % align == 0 else 1
    units = n // unit
    if units < size:
        raise SettingsError(f"cannot split {n} over {size} tensor-parallel ranks")
    base, extra = divmod(units, size)
    start = rank * base + min(rank, extra)
    return start * unit, (start + base + (rank < extra)) * unit


def check_divisible(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Raises SettingsError naming the head counts when ``size`` does not divide both."""
    if size < 1:
        raise SettingsError(f"tensor_parallel_size must be >= 1, got {size}")
    if num_heads % size or num_kv_heads % size:
        raise SettingsError(f"tensor_parallel_size {size} must divide the model's attention heads ({num_heads}) "
                            f"and KV heads ({num_kv_heads})")


def check_int4_groups(cfg, size: int, group_size: int) -> None:
    """Raises SettingsError when a rank's input columns of a row-parallel layer (o_proj: its
    heads; down_proj: its intermediate range) would cut int4's groups of ``group_size`` along
    K, naming ``--quant-group-size`` and the largest size that divides every cut; before
    anything is quantized or loaded."""
    import math
    cuts = []
    for r in range(size):
        plan = ShardPlan.of(cfg, r, size)
        cuts += [plan.heads[0] * cfg.head_dim, plan.heads[1] * cfg.head_dim, *plan.intermediate]
    bad = [c for c in cuts if c % group_size]
    if bad:
        fit = math.gcd(*cuts)
        raise SettingsError(f"tensor_parallel_size {size} cuts the int4 groups of {group_size} (--quant-group-size) at "
                            f"input column {bad[0]}; use a --quant-group-size dividing {fit}")


def check_split(cfg, size: int, weight_format: str, group_size: int) -> None:
    """Whether ``size`` ranks can split the model of ``cfg`` (a
    :class:`workers.models.llama.ModelConfig`) served in ``weight_format``: its head counts
    (:func:`check_divisible`) and, for int4, its groups of ``group_size``
    (:func:`check_int4_groups`). Raises SettingsError naming what does not fit."""
    check_divisible(cfg.num_heads, cfg.num_kv_heads, size)
    if size > 1 and weight_format == "int4":
        check_int4_groups(cfg, size, group_size)


@dataclass(frozen=True)
class ShardPlan:
    """The slices of a model a rank holds (all ``[start, end)``): attention heads, KV heads, MLP
    intermediate columns and token ids (lm_head rows); ``vocab_widths``: every rank's count of
    token ids (the logits gather's). ``rank`` 0 and ``size`` 1: everything."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_widths: tuple[int, ...]

    @classmethod
    def of(cls, cfg, rank: int = 0, size: int = 1) -> "ShardPlan":
        """The plan of ``rank`` for a :class:`workers.models.llama.ModelConfig`. Raises
        SettingsError for head counts ``size`` does not divide."""
        check_divisible(cfg.num_heads, cfg.num_kv_heads, size)
        if not 0 <= rank < size:
            raise SettingsError(f"tensor-parallel rank {rank} outside [0, {size})")
        h, kvh = cfg.num_heads // size, cfg.num_kv_heads // size
        vocab = [split_range(cfg.vocab_size, size, r, VOCAB_ALIGN) for r in range(size)]
        return cls(rank, size, (rank * h, (rank + 1) * h), (rank * kvh, (rank + 1) * kvh),
                   split_range(cfg.intermediate_size, size, rank, ALIGN), vocab[rank], tuple(e - s for s, e in vocab))

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


class TensorParallel:
    """A rank's place in its tensor-parallel group: its :class:`ShardPlan` and the communicator
    (:mod:`workers.communicator`) that sums and gathers across the group, given at construction
    or later (:meth:`connect`: the ranks load their weights before they meet). With one rank
    (``size`` 1) both are no-ops.

    ``comm_ns`` / ``comm_calls``: time spent in the communicator's calls (waiting for the other
    ranks included) and their count, since construction (``bench.tensor_parallel`` reads them)."""

    def __init__(self, plan: ShardPlan, comm=None):
        self.plan, self.comm = plan, comm
        self.comm_ns = self.comm_calls = 0

    def connect(self, comm) -> None:
        """Use ``comm`` (its ``all_reduce`` / ``all_gather``) from now on."""
        self.comm = comm

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def size(self) -> int:
        return self.plan.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of their ``x`` (the same shape and dtype on each), identical
        on every rank. Raises EngineError before :meth:`connect` (more than one rank)."""
        return x if self.plan.size == 1 else self._timed(self._comm().all_reduce, x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, V_r]`` float32 logits of this rank's token ids → ``[N, V]`` of all ranks' in
        rank order (every rank's ``V_r`` from its plan)."""
        if self.plan.size == 1:
            return logits
        return self._timed(self._comm().all_gather, logits.contiguous(), list(self.plan.vocab_widths))

    def _timed(self, call, *args) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        y = call(*args)
        self.comm_ns += time.perf_counter_ns() - t0
        self.comm_calls += 1
        return y

    def _comm(self):
        if self.comm is None:
            raise EngineError(f"tensor-parallel rank {self.plan.rank} of {self.plan.size} is not connected to its group")
        return self.comm

