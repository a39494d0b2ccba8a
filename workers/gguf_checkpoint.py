"""A GGUF file → our model with its block-quantized weights kept (weight format ``gguf``).

The known models are published as GGUF files (:mod:`kvmesh.hub`); ``kvmesh models pull``
keeps the file as ``<model dir>/model.gguf`` beside ``config.json`` and the tokenizer. Here it
is read (:class:`_Reader`) one tensor at a time, each only while it is
turned into its serving form (read, not mapped: no page of the file stays in the process's
memory):

- every Linear (q/k/v and gate/up stacked as in :mod:`workers.models.llama`) keeps its GGUF
  integers and scales in the ``gguf_linear`` kernel's representation
  (:mod:`workers.quant.gguf_blocks`, :meth:`workers.layers.linear.Linear.set_gguf`), then
  moved onto 2 MiB pages (:func:`workers.layers.linear.gguf_to_huge_pages`);
  a Linear whose parts share no exact common representation, or that is stored in a float
  type, is served dense (dequantized once, logged);
- the token embedding keeps its raw GGUF rows and dequantizes the rows a step looks up
  (:class:`GGUFEmbedding`); a tied lm_head is built from the same tensor;
- norm weights and biases (F32 in the file) load as float32 / the serving dtype.

Names: llama.cpp's (``blk.{i}.attn_q.weight`` ...; llama.cpp ``src/llama-arch.cpp``). For the
``llama`` architecture llama.cpp's converter permutes the rows of q and k (its
``LlamaModel.permute``: rotary pairs interleaved); the inverse row permutation restores the
Hugging Face order the model's RoPE expects. Qwen2 files are not permuted.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from kvmesh.core.errors import DependencyUnavailableError, SettingsError
from kvmesh.hub.cache import GGUF_FILE
from workers.layers.linear import GGUF_DENSE, Linear, gguf_to_huge_pages
from workers.models.llama import LlamaForCausalLM, ModelConfig
from workers.quant import gguf_blocks
from workers.tensor_parallel import TensorParallel

log = logging.getLogger("kvmesh.loader")

#: llama.cpp tensor names within a block → (our module path, shard)
_LAYER_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", "q"), "attn_k": ("self_attn.qkv_proj", "k"),
    "attn_v": ("self_attn.qkv_proj", "v"), "attn_output": ("self_attn.o_proj", ""),
    "ffn_gate": ("mlp.gate_up_proj", "gate"), "ffn_up": ("mlp.gate_up_proj", "up"),
    "ffn_down": ("mlp.down_proj", ""),
}
_LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def gguf_path(model_dir: str | Path) -> Path:
    """``<model_dir>/model.gguf`` (may not exist)."""
    return Path(model_dir) / GGUF_FILE


class GGUFEmbedding(nn.Module):
    """Token embedding kept as the GGUF's raw rows: ``raw`` uint8 ``[vocab, row bytes]`` of GGML
    type ``ggml_type``; ``forward(ids [T]) -> [T, hidden]`` of ``dtype`` dequantizes the T rows
    (:func:`workers.quant.gguf_blocks.dequantize_rows`)."""

    def __init__(self, raw: torch.Tensor, ggml_type: str, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("raw", raw)
        self.ggml_type, self.hidden, self.dtype = ggml_type, hidden, dtype

    @property
    def num_embeddings(self) -> int:
        return self.raw.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.raw.index_select(0, ids.reshape(-1))
        out = gguf_blocks.dequantize_rows(self.ggml_type, rows.cpu(), self.hidden).to(self.dtype)
        return out.to(ids.device).reshape(*ids.shape, self.hidden)


#: GGML type ids (ggml.h ``enum ggml_type``) of the types kvmesh reads
_GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
               14: "Q6_K", 30: "BF16"}
# GGUF metadata value types (gguf.h): fixed sizes; 8 = string, 9 = array
_GGUF_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class _Reader:
    """The tensors of a GGUF file (format versions 2 and 3, https://github.com/ggml-org/ggml
    docs/gguf.md), memory-mapped. Only what loading needs is parsed: ``general.architecture``,
    ``general.alignment`` and the tensor table; metadata arrays (the tokenizer's ~150k strings)
    are skipped over, not decoded (``gguf.GGUFReader`` decodes them: ~9 s for Qwen2.5's file).

    ``raw(name) -> (type name, tensor, K)``: a block type's rows as uint8 ``[rows, row bytes]``,
    a float type as ``[rows, K]`` (``[K]`` for a vector), read from the file (``preadv``) into
    a new tensor. The header is parsed through a memory map, closed before loading. Raises SettingsError naming the file for a file that
    is not GGUF, is cut short, or lacks a tensor."""

    def __init__(self, path: Path):
        import mmap
        import struct
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
            mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)     # the header only
        except (OSError, ValueError) as e:
            raise SettingsError(f"{path}: cannot read the GGUF file ({e})") from None
        pos = 0

        def take(fmt: str):
            nonlocal pos
            vals = struct.unpack_from("<" + fmt, mm, pos)
            pos += struct.calcsize("<" + fmt)
            return vals if len(vals) > 1 else vals[0]

        def string() -> str:
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(mm[pos - n:pos]).decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            nonlocal pos
            if vtype in _GGUF_SCALAR:
                pos += struct.calcsize(_GGUF_SCALAR[vtype])
            elif vtype == 8:
                pos += 8 + struct.unpack_from("<Q", mm, pos)[0]
            elif vtype == 9:
                etype, count = take("IQ")
                if etype in _GGUF_SCALAR:
                    pos += count * struct.calcsize(_GGUF_SCALAR[etype])
                else:
                    for _ in range(count):
                        skip(etype)
            else:
                raise ValueError(f"unknown metadata value type {vtype}")

        try:
            if mm[:4] != b"GGUF":
                raise ValueError("no GGUF magic")
            pos = 4
            version, n_tensors, n_kv = take("IQQ")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version}")
            self.arch, alignment = "", 32
            for _ in range(n_kv):
                key, vtype = string(), take("I")
                if key == "general.architecture" and vtype == 8:
                    self.arch = string()
                elif key == "general.alignment" and vtype == 4:
                    alignment = take("I")
                else:
                    skip(vtype)
            infos = []
            for _ in range(n_tensors):
                name, ndim = string(), take("I")
                dims = [take("Q") for _ in range(ndim)]
                ttype, offset = take("IQ")
                infos.append((name, dims, ttype, offset))
            base = (pos + alignment - 1) // alignment * alignment
            self.tensors = {}
            for name, dims, ttype, offset in infos:
                ty = _GGML_TYPES.get(ttype, f"GGML type {ttype}")
                k, rows = dims[0], 1
                for d in dims[1:]:
                    rows *= d
                if ty in gguf_blocks.FLOAT_TYPES:
                    nbytes = k * rows * gguf_blocks.FLOAT_TYPES[ty].itemsize
                elif ty in gguf_blocks.BLOCK:
                    bv, bb = gguf_blocks.BLOCK[ty]
                    nbytes = k // bv * bb * rows
                else:
                    nbytes = 0                  # unsupported: refused if a loader asks for it
                if base + offset + nbytes > len(mm):
                    raise ValueError(f"tensor {name!r} ends past the end of the file")
                self.tensors[name] = (ty, k, rows, base + offset, nbytes)
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            os.close(self._fd)
            raise SettingsError(f"{path}: not a readable GGUF file ({e})") from None
        finally:
            mm.close()

    def close(self) -> None:
        os.close(self._fd)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> tuple[str, torch.Tensor, int]:
        if name not in self.tensors:
            raise SettingsError(f"{self.path}: GGUF lacks tensor {name!r}")
        ty, k, rows, offset, nbytes = self.tensors[name]
        if ty not in gguf_blocks.FLOAT_TYPES and ty not in gguf_blocks.BLOCK:
            raise SettingsError(f"{self.path}: tensor {name!r} is {ty}, which kvmesh does not serve "
                                f"(it serves {', '.join([*gguf_blocks.FLOAT_TYPES, *gguf_blocks.BLOCK])})")
        # read, not a view of the map: pages of a map touched while loading count in the
        # process's RSS until it is unmapped (the whole file, on top of the repacked weights)
        data = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(data.numpy()), 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise SettingsError(f"{self.path}: file ends inside tensor {name!r}")
            done += got
        if ty in gguf_blocks.FLOAT_TYPES:
            t = data.view(gguf_blocks.FLOAT_TYPES[ty])
            return ty, (t.reshape(rows, k) if rows > 1 else t), k
        return ty, data.reshape(rows, -1), k


def _qk_rows(n_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: ``hf[r] = gguf[idx[r]]``."""
    n = n_heads * head_dim
    return torch.arange(n).view(n_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def _linear_parts(rd: _Reader, cfg: ModelConfig, lin: Linear, names: dict[str, str]):
    """Unpacked parts of ``lin`` in shard order (a tensor-parallel rank's part of each:
    :meth:`Linear.tp_part`), or None (then dense) with the reason."""
    parts, dense = [], None
    for shard in lin.shards:
        ty, raw, k = rd.raw(names[shard])
        if ty in gguf_blocks.FLOAT_TYPES:
            dense = f"{names[shard]} is {ty}"
            break
        u = gguf_blocks.unpack(ty, raw, k)
        if rd.arch == "llama" and shard in ("q", "k"):
            u = u.rows(_qk_rows(cfg.num_heads if shard == "q" else cfg.num_kv_heads, cfg.head_dim))
        try:
            u = lin.tp_part(shard, u)
        except ValueError as e:            # an input range that cuts the file's blocks
            dense = f"tensor parallelism: {e}"
            break
        parts.append(u)
    if dense is None:
        try:
            return gguf_blocks.stack(parts), None
        except ValueError as e:
            dense = str(e)
    return None, dense


def load_gguf(model_dir: str | Path, *, dtype: torch.dtype, device: str | torch.device, max_positions: int,
              start_layer: int = 0, end_layer: int | None = None, num_layers: int | None = None,
              requantize: str = "", tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """Build the model (or a pipeline stage, or its first ``num_layers`` layers, or a
    tensor-parallel rank's part: ``tp``) from
    ``<model_dir>/model.gguf`` with config.json from ``model_dir``; arguments as
    :func:`workers.loader.load_model`; ``requantize`` ``"q4_1"``: every block-quantized Linear
    with wider lanes requantized to Q4_1 (:func:`workers.quant.gguf_blocks.to_q4_1`; lossy). Raises SettingsError: no GGUF file, unreadable file,
    missing tensor, unsupported GGML type or shape mismatch; DependencyUnavailableError: another
    process's build of the native kernels outlasted ``KVMESH_KERNEL_BUILD_WAIT``."""
    import dataclasses

    from workers.checkpoint import check_servable, load_config
    model_dir = Path(model_dir)
    path = gguf_path(model_dir)
    if not path.is_file():
        raise SettingsError(f"{model_dir}: no {GGUF_FILE} (weight format gguf needs the published GGUF; "
                            "`kvmesh models pull` keeps it for known models)")
    cfg = load_config(model_dir)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise SettingsError(f"{model_dir}: cannot keep {num_layers} of its {cfg.num_layers} decoder layers")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    check_servable(model_dir, cfg, max_positions)
    rd = _Reader(path)
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, start_layer, end_layer, tp)
    try:
        _load_linears(rd, cfg, model, dtype, device, requantize)
        gguf_to_huge_pages(model)                   # decode streams them every step
        model.allocate_weights(dtype, device)       # norms, RoPE; the embedding is replaced below
        _load_rest(rd, cfg, model, dtype, device)
    except DependencyUnavailableError:          # not the file's fault: e.g. another process building the kernels
        raise
    except ValueError as e:
        raise SettingsError(f"{path}: {e}") from None
    finally:
        rd.close()
    return model.eval()


def _load_linears(rd: _Reader, cfg: ModelConfig, model: LlamaForCausalLM, dtype, device, requantize: str) -> None:
    jobs: list[tuple[Linear, dict[str, str], dict[str, str]]] = []      # (layer, weight names, bias names)
    for li, layer in enumerate(model.layers):
        i = model.start_layer + li
        by_mod: dict[str, tuple[dict, dict]] = {}
        for short, (mod, shard) in _LAYER_TENSORS.items():
            w, b = by_mod.setdefault(mod, ({}, {}))
            w[shard] = f"blk.{i}.{short}.weight"
            if f"blk.{i}.{short}.bias" in rd:
                b[shard] = f"blk.{i}.{short}.bias"
        for mod, (w, b) in by_mod.items():
            jobs.append((layer.get_submodule(mod), w, b))
    if model.is_last:
        head = "output.weight" if "output.weight" in rd else "token_embd.weight"     # tied
        jobs.append((model.lm_head, {"": head}, {}))
    for lin, wnames, bnames in jobs:
        u, why_dense = _linear_parts(rd, cfg, lin, wnames)
        bias = None
        if lin.bias is not None:
            if set(bnames) != set(lin.shards):
                raise ValueError(f"GGUF lacks the biases of {sorted(wnames.values())}")
            bias = torch.cat([lin.tp_part(s, rd.raw(bnames[s])[1].float().reshape(-1), 0) for s in lin.shards])
        if u is not None:
            if requantize == "q4_1":
                u = gguf_blocks.to_q4_1(u)
            if u.shape != (lin.out_features, lin.in_features):
                raise ValueError(f"{sorted(wnames.values())}: shape {list(u.shape)}, model expects "
                                 f"{[lin.out_features, lin.in_features]}")
            lin.set_gguf(u, bias, dtype, device)
            continue
        log.info("kvmesh: %s served dense (%s)", sorted(wnames.values()), why_dense)
        lin.allocate(dtype, device)
        for shard, name in wnames.items():
            ty, raw, k = rd.raw(name)
            w = gguf_blocks.dequantize_rows(ty, raw, k)
            if rd.arch == "llama" and shard in ("q", "k"):
                w = w[_qk_rows(cfg.num_heads if shard == "q" else cfg.num_kv_heads, cfg.head_dim)]
            lin.load_shard("weight", shard, w)          # each takes the rank's part
            if bias is not None:
                lin.load_shard("bias", shard, rd.raw(bnames[shard])[1].float().reshape(-1))
        lin.finalize(dtype)
        lin.method = GGUF_DENSE         # loaded: allocate_weights must not replace it


def _load_rest(rd: _Reader, cfg: ModelConfig, model: LlamaForCausalLM, dtype, device) -> None:
    def vec(name: str, like: torch.Tensor) -> None:
        t = rd.raw(name)[1].reshape(-1)
        if t.numel() != like.numel():
            raise ValueError(f"{name}: {t.numel()} values, model expects {like.numel()}")
        like.data.copy_(t)

    for li, layer in enumerate(model.layers):
        i = model.start_layer + li
        for short, attr in _LAYER_NORMS.items():
            vec(f"blk.{i}.{short}.weight", getattr(layer, attr).weight)
    if model.is_last:
        vec("output_norm.weight", model.norm.weight)
    if model.is_first:
        ty, raw, k = rd.raw("token_embd.weight")
        if raw.shape[0] != cfg.vocab_size or k != cfg.hidden_size:
            raise ValueError(f"token_embd.weight: [{raw.shape[0]}, {k}], model expects "
                             f"[{cfg.vocab_size}, {cfg.hidden_size}]")
        if ty not in gguf_blocks.FLOAT_TYPES and ty not in gguf_blocks.BLOCK:
            raise ValueError(f"token_embd.weight: GGUF type {ty} is not supported")
        raw = raw if ty not in gguf_blocks.FLOAT_TYPES else raw.contiguous().view(torch.uint8).reshape(raw.shape[0], -1)
        model.embed_tokens = GGUFEmbedding(raw.to(device), ty, cfg.hidden_size, dtype)


def is_gguf_model(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a GGUF file the ``gguf`` weight format can serve."""
    return gguf_path(model_dir).is_file()

