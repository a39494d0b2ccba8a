"""Quantized checkpoints: quantize a dense model once, save it, load it (or a pipeline stage
of it) without recalibrating.

A quantized checkpoint is a directory holding ``model.safetensors`` (every tensor of the whole
model, named by module path with global layer numbers: ``layers.3.mlp.down_proj.qweight``,
``layers.3.input_layernorm.weight``, ``embed_tokens.weight`` ...), the source's
``config.json`` and ``quant.json``: ``{"format", "group_size", "calibration": {"enabled",
"source", "sha256", "tokens"}, "layer_formats": {linear name: format}, "awq_alpha": {...},
"version"}``. Loading it gives bit-identical weights every time (no arithmetic on load besides
the device layout of :func:`workers.layers.quant.to_runtime`).

:func:`ensure_quantized` keeps such directories as a cache under
``$KVMESH_HOME/quantized/<model>/<key>``, keyed by the source checkpoint (path, config.json,
weight file names/sizes/mtimes), the format, the int4 group size, calibration on/off and the
calibration text's hash. The first process that needs one builds it from the whole dense model
(calibration needs every layer) under a file lock; pipeline stages then read only their
layers from it.

Which layers get which format: every decoder Linear gets ``format``; the lm_head gets
:data:`LM_HEAD_FORMAT` (int8 weight-only for int4 and w8a8-int8, as AWQ and llama.cpp keep the
output projection at higher precision). Embeddings and norms stay dense (float32 on disk,
the serving dtype in memory); calibration only rescales the norm weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from kvmesh.core.engine_config import WEIGHT_FORMATS
from kvmesh.core.errors import EngineError
from workers.layers import quant
from workers.layers.linear import Linear
from workers.checkpoint import SafetensorsFile

VERSION = 1
LM_HEAD_FORMAT = {"int8": "int8", "int4": "int8", "fp8": "fp8", "w8a8-int8": "int8"}
CALIBRATED_FORMATS = ("int4", "w8a8-int8")
# linear (name within a decoder layer) -> the RMSNorm whose output is its only input
NORM_BEFORE = {"self_attn.qkv_proj": "input_layernorm", "mlp.gate_up_proj": "post_attention_layernorm"}
QUANT_KEYS = ("qweight", "scales", "zeros", "bias", "input_scale")


def weight_identity(weight_format: str, group_size: int, calibration: bool, calibration_data: str) -> str:
    """Short tag of the weights' format, part of the prefix-cache block-hash seed: ``none``,
    ``int8``, ``fp8``, ``int4-g128-awq:<hash>``, ``int4-g64-rtn``, ``w8a8-int8-sq:<hash>``,
    ``w8a8-int8-rtn`` (hash = first 12 hex digits of the calibration text's SHA-256)."""
    if weight_format not in CALIBRATED_FORMATS:
        return weight_format
    tag = weight_format + (f"-g{group_size}" if weight_format == "int4" else "")
    if not calibration:
        return tag + "-rtn"
    from workers.quant.calibrate import calibration_text
    method = "awq" if weight_format == "int4" else "sq"
    return f"{tag}-{method}:{calibration_text(calibration_data).sha256[:12]}"


def _checkpoint_digest(model_dir: Path) -> str:
    h = hashlib.sha256(f"v{VERSION}:{model_dir.resolve()}".encode())
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def cache_dir(model_dir: str | Path, weight_format: str, group_size: int, calibration: bool,
              calibration_data: str) -> Path:
    """Where :func:`ensure_quantized` keeps the quantized checkpoint of these settings."""
    from kvmesh.hub.cache import kvmesh_home
    model_dir = Path(model_dir)
    tag = weight_identity(weight_format, group_size, calibration, calibration_data).replace(":", "-")
    return kvmesh_home() / "quantized" / model_dir.name / f"{tag}-{_checkpoint_digest(model_dir)}"


def ensure_quantized(model_dir: str | Path, weight_format: str, group_size: int = 128,
                     calibration: bool = True, calibration_data: str = "") -> Path:
    """The cached quantized checkpoint of ``model_dir`` in these settings, built (whole model,
    calibrated when the format uses it) when missing. Safe against concurrent callers (a file
    lock; the directory appears complete, by rename). A pulled known model gets its dense
    safetensors first (:func:`kvmesh.hub.pull.ensure_dense`: converted from its GGUF once; its errors
    propagate). Returns its directory."""
    from kvmesh.hub.pull import ensure_dense
    ensure_dense(Path(model_dir), why=f"--weight-format {weight_format}")
    target = cache_dir(model_dir, weight_format, group_size, calibration, calibration_data)
    if (target / "quant.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "quant.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            save_quantized(model_dir, tmp, weight_format, group_size, calibration, calibration_data)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def quantize_model(model, weight_format: str, group_size: int, stats: dict | None) -> tuple[dict, dict]:
    """Quantize a dense, finalized float32 whole model (:func:`workers.checkpoint.load_dense`).
    ``stats``: :func:`workers.quant.calibrate.collect_stats` output
    (None = round-to-nearest, no smoothing). Returns (tensors by global name, quant.json
    fields ``layer_formats`` and ``awq_alpha``)."""
    from workers.quant.calibrate import awq_scale, smoothquant_scale
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    tensors = {n: p.detach().float().clone() for n, p in model.named_parameters()
               if n.rsplit(".", 1)[0] not in linears}
    formats, alphas = {}, {}
    for name, lin in linears.items():
        w = lin.weight.data.t().float()                      # finalize stored [K, N]
        fmt = LM_HEAD_FORMAT[weight_format] if name == "lm_head" else weight_format
        out: dict[str, torch.Tensor] = {}
        if stats is not None and name in stats and fmt == weight_format and fmt in CALIBRATED_FORMATS:
            if fmt == "int4":
                s, alphas[name] = awq_scale(w, stats[name], group_size)
            else:
                s = smoothquant_scale(w, stats[name])
            w = w * s
            layer, _, sub = name.partition(".")[2].partition(".")   # "3", "self_attn.qkv_proj"
            if sub in NORM_BEFORE:
                norm = f"layers.{layer}.{NORM_BEFORE[sub]}.weight"
                tensors[norm] = tensors[norm] / s
            else:
                out["input_scale"] = 1.0 / s
        if fmt == "int4":
            w = F.pad(w, (0, (-w.shape[1]) % group_size))        # K padded to the group size
        out.update(quant.quantize(w, fmt, group_size))
        if lin.bias is not None:
            out["bias"] = lin.bias.data.float().clone()
        for k, t in out.items():
            tensors[f"{name}.{k}"] = t.contiguous()
        formats[name] = fmt
    return tensors, {"layer_formats": formats, "awq_alpha": alphas}


def save_quantized(model_dir: str | Path, out_dir: str | Path, weight_format: str, group_size: int = 128,
                   calibration: bool = True, calibration_data: str = "") -> Path:
    """Load the dense checkpoint ``model_dir`` (whole model, float32, CPU), calibrate when
    ``calibration`` and the format uses it (int4: AWQ, w8a8-int8: SmoothQuant), quantize and
    write a quantized checkpoint to ``out_dir`` (created). Returns ``out_dir``.
    Raises EngineError for an unknown format or unusable calibration data."""
    from workers.checkpoint import load_dense
    from workers.quant import calibrate
    if weight_format not in WEIGHT_FORMATS or weight_format == "none":
        raise EngineError(f"weight_format {weight_format!r} is not a quantized format")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    model = load_dense(model_dir, dtype=torch.float32, device="cpu", max_positions=calibrate.CHUNK_TOKENS)
    stats, calib = None, {"enabled": False}
    if calibration and weight_format in CALIBRATED_FORMATS:
        text = calibrate.calibration_text(calibration_data)
        chunks = calibrate.calibration_chunks(model_dir, text)
        stats = calibrate.collect_stats(model, chunks, names=[n for n, m in model.named_modules()
                                                             if isinstance(m, Linear) and n != "lm_head"])
        calib = {"enabled": True, "source": text.source, "sha256": text.sha256,
                 "tokens": sum(len(c) for c in chunks),
                 "method": "awq" if weight_format == "int4" else "smoothquant"}
    tensors, fields = quantize_model(model, weight_format, group_size, stats)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    shutil.copy(model_dir / "config.json", out_dir / "config.json")
    meta = {"version": VERSION, "format": weight_format, "group_size": group_size, "calibration": calib,
            "source": str(model_dir.resolve()), **fields}
    (out_dir / "quant.json").write_text(json.dumps(meta, indent=1))
    return out_dir


def _global_name(name: str, start_layer: int) -> str:
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"layers.{int(i) + start_layer}.{rest}"
    return name


def tp_part_quantized(lin: Linear, fmt: str, ts: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """A tensor-parallel rank's part of a Linear's quantized tensors (the whole layer's, stacked
    as :func:`quantize_model` stores them; :meth:`Linear.tp_index`): column-parallel (``tp_dim`` 0)
    takes its rows of every per-row tensor; row-parallel (1) its columns of ``qweight`` (two per
    byte for int4), of int4's per-group ``scales`` / ``zeros`` and of ``input_scale``; per-row
    scales stay whole. Raises EngineError for a column range that cuts an int4 group."""
    idx = lin.tp_index()
    if lin.tp_dim == 0:
        return {k: (t if k == "input_scale" else t.index_select(0, idx)) for k, t in ts.items()}
    out = dict(ts)
    start, end = int(idx[0]), int(idx[-1]) + 1
    if fmt == "int4":
        if start % group_size or end % group_size:
            raise EngineError(f"tensor parallelism: columns [{start}, {end}) cut the int4 groups of {group_size}; "
                              f"choose a quant_group_size dividing them")
        out["qweight"] = ts["qweight"][:, start // 2: end // 2]
        out["scales"] = ts["scales"][:, start // group_size: end // group_size]
        out["zeros"] = ts["zeros"][:, start // group_size: end // group_size]
    else:
        out["qweight"] = ts["qweight"][:, start:end]
    if "input_scale" in ts:
        out["input_scale"] = ts["input_scale"][start:end]
    return {k: t.contiguous() for k, t in out.items()}


def load_quantized(qdir: str | Path, *, dtype: torch.dtype, device: str | torch.device, max_positions: int,
                   start_layer: int = 0, end_layer: int | None = None, tp=None):
    """Build the model (or the stage ``[start_layer, end_layer)``, or a tensor-parallel rank's
    part of it: ``tp``, :mod:`workers.tensor_parallel`) from a quantized checkpoint.
    Raises EngineError when the directory is not one (no quant.json / config.json)."""
    from workers.checkpoint import check_servable, load_config
    from workers.models.llama import LlamaForCausalLM
    qdir = Path(qdir)
    if not (qdir / "quant.json").is_file():
        raise EngineError(f"{qdir}: no quant.json (not a quantized checkpoint)")
    meta = json.loads((qdir / "quant.json").read_text())
    cfg = load_config(qdir)
    check_servable(qdir, cfg, max_positions)
    with torch.device("meta"):           # no storage; the quantized tensors replace the Linears'
        model = LlamaForCausalLM(cfg, max_positions, start_layer, end_layer, tp)
    device = torch.device(device)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    with SafetensorsFile(qdir / "model.safetensors") as sf:     # one tensor in memory at a time
        for name, lin in linears.items():
            g = _global_name(name, start_layer)
            ts = {k: sf.get(f"{g}.{k}") for k in QUANT_KEYS if f"{g}.{k}" in sf}
            if lin.tp_parts is not None:
                ts = tp_part_quantized(lin, meta["layer_formats"][g], ts, meta["group_size"])
            lin.set_quantized(meta["layer_formats"][g], ts, dtype, device, meta["group_size"])
        model.allocate_weights(dtype, device)     # embeddings, norms, RoPE tables
        for name, p in model.named_parameters():
            if name.rsplit(".", 1)[0] in linears:
                continue
            g = _global_name(name, start_layer)
            if g not in sf:
                raise EngineError(f"{qdir}: quantized checkpoint lacks {g!r}")
            if p.dim() == 0 or tuple(p.shape) != sf.shape(g):
                p.data.copy_(sf.get(g))         # a shape mismatch raises here
                continue
            step = max(1, (16 << 20) // max(1, p[0].numel() * 4))   # ~16 MiB of float32 rows at a time
            for i in range(0, p.shape[0], step):
                p.data[i:i + step].copy_(sf.get(g, i, min(i + step, p.shape[0])))
    model.finalize(dtype)
    return model.to(device).eval()
