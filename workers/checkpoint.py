"""A Hugging Face checkpoint directory (config.json + *.safetensors) → our dense model.

Memory plan: the model is built on the ``meta`` device (no storage), its weights are then
allocated once, uninitialised, in the serving dtype and layout on the target device
(:meth:`LlamaForCausalLM.allocate_weights`), and the checkpoint is streamed into them one
tensor at a time (:class:`SafetensorsFile`: plain reads, no mmap, so file pages never count
in the process's RSS). Peak memory is the served weights plus the largest checkpoint tensor in
its file dtype. transformers' model classes are never instantiated. Errors a user can fix
(unknown architecture, missing or extra tensor, shape mismatch, no weights, a malformed weight
file) raise :class:`kvmesh.core.errors.SettingsError`.

The quantized formats build on this module (:mod:`workers.quant.store` reads the dense model
and its own checkpoints with it); :func:`workers.loader.load_model` chooses between the two.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import torch

from kvmesh.core.errors import EngineError, SettingsError
from workers.models.llama import LlamaForCausalLM, ModelConfig
from workers.tensor_parallel import TensorParallel


def load_config(model_dir: str | Path) -> ModelConfig:
    """Parse ``config.json``. Raises SettingsError when missing or unsupported."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise SettingsError(f"{model_dir}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except (ValueError, KeyError) as e:
        raise SettingsError(f"{model_dir}: {e if isinstance(e, ValueError) else f'config.json lacks {e}'}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of ``model_dir`` (from model.safetensors.index.json, else every *.safetensors),
    sorted. Raises SettingsError when there is none."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SettingsError(f"{model_dir}: no *.safetensors weight files")
    return files


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """A ``.safetensors`` file read one tensor at a time with plain ``readinto`` calls.

    safetensors' own ``safe_open`` maps the whole file; every page read through the map stays
    in the process's RSS until the file is closed, so reading a checkpoint through it costs
    up to the file's size on top of the model. Here each :meth:`get` allocates exactly its
    tensor (CPU, the file's dtype) and nothing else stays resident.

    Format (https://github.com/huggingface/safetensors): little-endian u64 header length N,
    N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?}``,
    then the data; offsets are relative to the end of the header.

    Use as a context manager. Raises SettingsError (naming the file) for a file that is not
    valid safetensors (bad header, unsupported dtype, offsets past the end of the file).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fh = open(self.path, "rb", buffering=0)
        try:
            size = self.path.stat().st_size
            raw = self._fh.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than 8 bytes")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(self._fh.read(n))
            self.metadata: dict = header.pop("__metadata__", None) or {}
            self._base = 8 + n
            self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            for name, e in header.items():
                if e["dtype"] not in _ST_DTYPES:
                    raise ValueError(f"tensor {name!r} has unsupported dtype {e['dtype']}")
                dtype, shape = _ST_DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
                numel = 1
                for d in shape:
                    numel *= d
                if end - begin != numel * dtype.itemsize or begin < 0 or self._base + end > size:
                    raise ValueError(f"tensor {name!r}: data_offsets {begin}..{end} do not fit "
                                     f"shape {list(shape)} {e['dtype']} in a {size}-byte file")
                self._entries[name] = (dtype, shape, begin, end)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            self._fh.close()
            raise SettingsError(f"{self.path}: not a valid safetensors file ({e})") from None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()

    def keys(self) -> list[str]:
        """Tensor names in the order of their data in the file (sequential reads)."""
        return sorted(self._entries, key=lambda k: self._entries[k][2])

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of tensor ``name``. Raises KeyError for an unknown name."""
        return self._entries[name][1]

    def get(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Read tensor ``name``, or its rows ``[start, stop)`` along dim 0, into a new CPU
        tensor of its stored dtype. Raises KeyError for an unknown name, ValueError for rows
        out of range, SettingsError when the file is cut short."""
        dtype, shape, begin, end = self._entries[name]
        if start or stop is not None:
            rows = shape[0] if shape else 0
            stop = rows if stop is None else stop
            if not 0 <= start <= stop <= rows:
                raise ValueError(f"rows {start}:{stop} of {name!r} with {rows} rows")
            row_bytes = (end - begin) // rows if rows else 0
            begin, end, shape = begin + start * row_bytes, begin + stop * row_bytes, (stop - start, *shape[1:])
        buf = torch.empty(end - begin, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        self._fh.seek(self._base + begin)
        while done < len(view):
            got = self._fh.readinto(view[done:])
            if not got:
                raise SettingsError(f"{self.path}: file ends inside tensor {name!r}")
            done += got
        return buf.view(dtype).reshape(shape)


def iter_tensors(files: list[Path]):
    """Yield ``(name, tensor)`` for every tensor of ``files``, each read on demand in its
    stored dtype (the consumer copies it into the model, then it is freed)."""
    for f in files:
        with SafetensorsFile(f) as sf:
            for name in sf.keys():
                yield name, sf.get(name)


def check_servable(model_dir: Path, cfg: ModelConfig, max_positions: int) -> None:
    """Raises SettingsError for a checkpoint the attention cannot serve at ``max_positions``."""
    if cfg.sliding_window is not None and cfg.sliding_window < max_positions:
        raise SettingsError(f"{model_dir}: sliding-window attention ({cfg.sliding_window} tokens) is not supported; "
                            f"use max_model_len <= {cfg.sliding_window}")


def load_dense(model_dir: str | Path, *, dtype: torch.dtype, device: str | torch.device, max_positions: int,
               start_layer: int = 0, end_layer: int | None = None, num_layers: int | None = None,
               tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """Build the dense model (or a pipeline stage of it, or a tensor-parallel rank's part: ``tp``)
    from the checkpoint ``model_dir`` and load its weights; the arguments are
    :func:`workers.loader.load_model`'s. Peak RSS growth while
    loading is about the served weight bytes plus the largest checkpoint tensor in its file
    dtype. Raises SettingsError: unsupported architecture, missing/unexpected tensor, shape
    mismatch, malformed weight file, ``num_layers`` out of range."""
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise SettingsError(f"{model_dir}: cannot keep {num_layers} of its {cfg.num_layers} decoder layers")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    check_servable(model_dir, cfg, max_positions)
    with torch.device("meta"):           # no storage: the weights are allocated once, below
        model = LlamaForCausalLM(cfg, max_positions, start_layer, end_layer, tp)
    model.allocate_weights(dtype, device)
    try:
        tensors = iter_tensors(safetensors_files(model_dir))
        if num_layers is not None:     # drop the tensors of the layers cut off
            tensors = ((n, t) for n, t in tensors
                       if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= num_layers))
        model.load_weights(tensors)
    except EngineError:
        raise
    except ValueError as e:
        raise SettingsError(f"{model_dir}: {e}") from None
    model.finalize(dtype)
    return model.to(device).eval()
