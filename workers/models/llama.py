"""Decoder-only transformer of the Llama family (Llama, Qwen2, Mistral), config-driven.

Plain PyTorch in the manner of gpt-fast. Differences between the families are config
switches: Qwen2 has a bias on q/k/v; Llama may have ``attention_bias``; the lm_head may be
tied to the embeddings. Architecture: pre-norm RMSNorm (Zhang & Sennrich 2019), RoPE, grouped-query attention,
SwiGLU MLP (Shazeer 2020).

The module can hold a contiguous range of decoder layers (a pipeline stage): the first stage
owns the embeddings, the last the final norm and lm_head. Under tensor parallelism it holds one
rank's part of each layer (:mod:`workers.tensor_parallel`: its heads, its MLP columns, its token
ids' lm_head rows) and sums the parts after o_proj and down_proj.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.layers.attention import AttentionMetadata, paged_attention
from workers.layers.linear import Linear
from workers.layers.rotary import RotaryEmbedding
from workers.tensor_parallel import ShardPlan, TensorParallel

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` that the model needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed config.json. Raises ValueError for unsupported architectures."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                             f"kvmesh serves {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "MistralForCausalLM") else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            sliding_window=window,
        )


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32. x: ``[T, hidden]``.

    ``forward(x, residual)`` with a residual ``[T, hidden]`` first adds it (``x + residual``,
    the pre-norm block's skip connection) and returns ``(norm(x + residual), x + residual)``:
    the residual add and the norm that follows it are one call (vLLM's ``fused_add_rms_norm``),
    one fused pass under ``torch.compile``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.native = False     # kvmesh::rms_norm / add_rms_norm (set by use_native_ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.native and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            if residual is None:
                return torch.ops.kvmesh.rms_norm(x, self.weight, self.eps)
            return torch.ops.kvmesh.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * self.weight.float()).to(x.dtype)
        return out if residual is None else (out, residual)


def use_native_ops(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Run the model's elementwise work through the native fused kernels
    (:mod:`workers.kernels`) when it serves on the CPU and the kernels are built: every
    RMSNorm (``kvmesh::rms_norm`` / ``add_rms_norm``) for bfloat16 and float16, and the
    rotary embedding (``kvmesh::rotary_bf16``, bit-identical to the PyTorch expression) and the
    MLP's ``silu(gate) * up`` (``kvmesh::silu_and_mul_bf16``, within one bfloat16 ulp) for
    bfloat16. One op per norm and per rotation instead of ~8 and 7 (at batch 1 the dispatch
    cost is what these ops cost; at prefill, the passes over memory). float32 keeps the
    PyTorch expressions (the reference of the parity tests). Returns how many modules switched."""
    if dtype not in (torch.bfloat16, torch.float16) or device.type != "cpu":
        return 0
    from workers import kernels
    if not kernels.available():
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.native, n = True, n + 1
        elif isinstance(m, Attention) and dtype == torch.bfloat16:
            m.native_rope, n = True, n + 1
        elif isinstance(m, MLP) and dtype == torch.bfloat16:
            m.native_act, n = True, n + 1
    return n


def _reduce(tp: TensorParallel | None):
    """The all-reduce a row-parallel layer's output takes (None: one rank, nothing to sum)."""
    return tp.all_reduce if tp is not None and tp.size > 1 else None


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache: this rank's heads (all of them without
    tensor parallelism); o_proj's partial outputs summed across the ranks."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, plan: ShardPlan, tp: TensorParallel | None = None):
        super().__init__()
        self.h, self.kvh, self.d = plan.num_heads, plan.num_kv_heads, cfg.head_dim
        d, (h0, h1), (k0, k1) = self.d, plan.heads, plan.kv_heads
        H, KVH = cfg.num_heads * d, cfg.num_kv_heads * d
        tp_args = lambda dim, parts, full: {} if plan.size == 1 else {"tp_dim": dim, "tp_parts": parts, "tp_full": full}
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=cfg.qkv_bias,
                               shards={"q": self.h * self.d, "k": self.kvh * self.d, "v": self.kvh * self.d},
                               **tp_args(0, {"q": (h0 * d, h1 * d), "k": (k0 * d, k1 * d), "v": (k0 * d, k1 * d)},
                                         {"q": H, "k": KVH, "v": KVH}))
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, **tp_args(1, {"": (h0 * d, h1 * d)}, {"": H}))
        self.reduce = _reduce(tp)
        self.rope = rope
        self.scale = self.d ** -0.5
        self.native_rope = False      # kvmesh::rotary_bf16 (set by use_native_ops)

    def forward(self, x, cos_sin, md: AttentionMetadata, kv_cache):
        """x: ``[T, hidden]``; cos_sin: the step's rotary table rows (:meth:`RotaryEmbedding.cos_sin`)."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are adjacent in the projection: one rotation covers both heads' groups
        qk = qkv[:, : (self.h + self.kvh) * self.d].view(T, self.h + self.kvh, self.d)
        qk = torch.ops.kvmesh.rotary_bf16(qk, *cos_sin) if self.native_rope else self.rope.rotate(qk, *cos_sin)
        q, k = qk[:, : self.h], qk[:, self.h:]
        v = qkv[:, (self.h + self.kvh) * self.d:].view(T, self.kvh, self.d)
        o = paged_attention(q, k, v, kv_cache, md, self.scale)
        o = self.o_proj(o.reshape(T, self.h * self.d))
        return o if self.reduce is None else self.reduce(o)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a stacked ``[T, 2 * I]`` gate/up projection → ``[T, I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU over this rank's intermediate columns; down_proj's partial outputs summed across
    the ranks."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, tp: TensorParallel | None = None):
        super().__init__()
        self.inter = plan.intermediate_size
        part = plan.intermediate
        split = plan.size > 1
        full = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, shards={"gate": self.inter, "up": self.inter},
                                   **({"tp_dim": 0, "tp_parts": {"gate": part, "up": part},
                                       "tp_full": {"gate": full, "up": full}} if split else {}))
        self.down_proj = Linear(self.inter, cfg.hidden_size,
                                **({"tp_dim": 1, "tp_parts": {"": part}, "tp_full": {"": full}} if split else {}))
        self.reduce = _reduce(tp)
        self.native_act = False       # kvmesh::silu_and_mul_bf16 (set by use_native_ops)

    def forward(self, x):
        h = self.gate_up_proj(x)
        y = self.down_proj(torch.ops.kvmesh.silu_and_mul_bf16(h) if self.native_act else silu_and_mul(h))
        return y if self.reduce is None else self.reduce(y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, plan: ShardPlan, tp: TensorParallel | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, plan, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, plan, tp)

    def forward(self, x, residual, cos_sin, md, kv_cache):
        """``(x, residual) -> (x, residual)``: the pre-norm block with its skip connections
        deferred into the next norm (``residual`` None on the first layer; the caller adds the
        last layer's pair)."""
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, md, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Layers ``[start_layer, end_layer)`` of the model.

    ``forward(x, positions, md, kv_caches)``: on the first stage ``x`` is input ids ``[T]``
    int64, otherwise hidden states ``[T, hidden]``; returns hidden states ``[T, hidden]`` (after
    the final norm on the last stage). ``kv_caches[i]`` is the
    :class:`workers.kv_cache.KVCache` of the stage's i-th layer (this rank's KV heads under
    tensor parallelism). ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32 (every
    rank's token ids, gathered).

    ``tp``: this rank's :class:`workers.tensor_parallel.TensorParallel` (None: the whole of each
    layer). Raises SettingsError for head counts its size does not divide.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, start_layer: int = 0, end_layer: int | None = None,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.plan = plan = tp.plan if tp is not None else ShardPlan.of(cfg)
        self.start_layer = start_layer
        self.end_layer = cfg.num_layers if end_layer is None else end_layer
        self.is_first = start_layer == 0
        self.is_last = self.end_layer == cfg.num_layers
        # Under torch.device("meta") (workers.checkpoint) only allocations happen: the RoPE table
        # is computed on the CPU, the embedding is not initialised (it is always loaded); any
        # computation on meta tensors would import torch's meta kernels (~75 MB of RSS).
        with torch.device("cpu"):
            rope = self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                          _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
                             if self.is_first else None)
        self.embed_tokens and self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, plan, tp) for _ in range(self.start_layer, self.end_layer))
        if self.is_last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = Linear(cfg.hidden_size, plan.vocab_size,
                                  **({"tp_dim": 0, "tp_parts": {"": plan.vocab}, "tp_full": {"": cfg.vocab_size}}
                                     if plan.size > 1 else {}))

    def forward(self, x, positions, md: AttentionMetadata, kv_caches) -> torch.Tensor:
        h = self.embed_tokens(x) if self.is_first else x
        cos_sin = self.rope.cos_sin(positions, h.dtype)      # once per step, not per layer
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, cos_sin, md, kv)
        if residual is not None:
            if self.is_last:
                return self.norm(h, residual)[0]
            return h + residual
        return self.norm(h) if self.is_last else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits if self.plan.size == 1 else self.tp.gather_logits(logits)

    # ---- weight loading -------------------------------------------------------------
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors. Raises ValueError naming an unexpected tensor, a
        shape mismatch or a tensor the checkpoint lacks."""
        loaded: set[str] = set()
        tie = self.cfg.tie_word_embeddings
        for name, t in tensors:
            if "rotary_emb.inv_freq" in name:
                continue
            if tie and name == "model.embed_tokens.weight" and self.is_last:
                self.lm_head.load_shard("weight", "", t)
            target = self._route(name)
            if target is _SKIP:
                continue
            if target is None:
                raise ValueError(f"unexpected tensor {name!r} in checkpoint")
            try:
                if isinstance(target, tuple):
                    lin, param, shard = target
                    lin.load_shard(param, shard, t)
                else:
                    if target.shape != t.shape:
                        raise ValueError(f"shape mismatch: checkpoint {tuple(t.shape)}, model expects {tuple(target.shape)}")
                    target.data.copy_(t)
            except ValueError as e:
                raise ValueError(f"tensor {name!r}: {e}") from None
            loaded.add(name)
        missing = [n for n in self._expected_names() if n not in loaded]
        for mod_name, mod in self.named_modules():
            if isinstance(mod, Linear) and mod.missing() and not (tie and mod is getattr(self, "lm_head", None)):
                missing.append(f"{mod_name}: {mod.missing()}")
        if self.is_last and tie and self.lm_head.missing():
            missing.append("model.embed_tokens.weight (tied lm_head)")
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _expected_names(self) -> list[str]:
        names = []
        if self.is_first:
            names.append("model.embed_tokens.weight")
        for i in range(self.start_layer, self.end_layer):
            names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
        if self.is_last:
            names.append("model.norm.weight")
        return names

    def _route(self, name: str):
        """Map a checkpoint name to a parameter, a (Linear, param, shard) tuple, _SKIP (belongs
        to another stage) or None (unknown)."""
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.weight if self.is_first else _SKIP
        if name == "model.norm.weight":
            return self.norm.weight if self.is_last else _SKIP
        if name == "lm_head.weight":
            return (self.lm_head, "weight", "") if self.is_last else _SKIP
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return None
        i = int(parts[2])
        if not self.start_layer <= i < self.end_layer:
            return _SKIP if i < self.cfg.num_layers else None
        layer = self.layers[i - self.start_layer]
        rest = ".".join(parts[3:])
        param = parts[-1]
        table = {
            "self_attn.q_proj": (layer.self_attn.qkv_proj, "q"),
            "self_attn.k_proj": (layer.self_attn.qkv_proj, "k"),
            "self_attn.v_proj": (layer.self_attn.qkv_proj, "v"),
            "self_attn.o_proj": (layer.self_attn.o_proj, ""),
            "mlp.gate_proj": (layer.mlp.gate_up_proj, "gate"),
            "mlp.up_proj": (layer.mlp.gate_up_proj, "up"),
            "mlp.down_proj": (layer.mlp.down_proj, ""),
        }
        prefix = rest.rsplit(".", 1)[0]
        if prefix in table:
            lin, shard = table[prefix]
            return (lin, param, shard)
        if rest == "input_layernorm.weight":
            return layer.input_layernorm.weight
        if rest == "post_attention_layernorm.weight":
            return layer.post_attention_layernorm.weight
        return None

    def allocate_weights(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """Replace the tensors of a model built under ``torch.device("meta")`` by real,
        uninitialised ones on ``device``, already in the serving format :meth:`finalize`
        produces, so that loading holds one copy of the weights: dense Linears ``dtype``,
        transposed (:meth:`Linear.allocate`), embeddings ``dtype``, RMSNorm weights float32;
        the RoPE tables (computed on the CPU by the constructor) are moved to ``device``.
        Quantized Linears are left as they are. Every value except the RoPE tables must then
        be loaded (:meth:`load_weights` checks that none is missing).

        Raises:
            RuntimeError: a parameter or buffer is still on the meta device afterwards (a
                module this method does not know).
        """
        device = torch.device(device)
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.allocate(dtype, device)
            elif isinstance(mod, RMSNorm):
                mod.weight = nn.Parameter(torch.empty(mod.weight.shape, dtype=torch.float32, device=device),
                                          requires_grad=False)
            elif isinstance(mod, nn.Embedding):
                mod.weight = nn.Parameter(torch.empty(mod.weight.shape, dtype=dtype, device=device),
                                          requires_grad=False)
            elif isinstance(mod, RotaryEmbedding):
                mod.to(device)                      # in place: the layers share this module
        left = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t is not None and t.is_meta]
        if left:
            raise RuntimeError(f"allocate_weights does not know how to allocate {left[:5]}")

    def finalize(self, dtype: torch.dtype) -> None:
        """Convert every weight to the serving dtype (norm weights stay float32)."""
        for mod in self.modules():
            if isinstance(mod, Linear):
                mod.finalize(dtype)
        if self.embed_tokens is not None:
            self.embed_tokens.weight.data = self.embed_tokens.weight.data.to(dtype)


_SKIP = object()
