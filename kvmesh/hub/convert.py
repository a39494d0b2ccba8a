"""GGUF → Hugging Face files: config and tokenizer from the GGUF's metadata, and on request the
dense weights (dequantized with transformers, matrices stored in bfloat16).

:func:`write_serving_files` writes what serving the GGUF itself needs beside it (config.json,
tokenizer, chat template, generation_config.json) from the GGUF's metadata, without loading the
model: every pull does this. :func:`convert` writes a whole dense checkpoint (the same files plus
``*.safetensors``): only :func:`kvmesh.hub.pull.ensure_dense` (``--weight-format none`` and the
formats quantized from the dense model, ``kvmesh models pull --dense``) runs it.

Storage precision of the dense weights (:data:`kvmesh.hub.cache.FORMAT_VERSION` 2 and up):
matrices (every tensor of 2 or
more dimensions) are stored in bfloat16, vectors (RMSNorm weights, biases) in float32. In the
pinned GGUFs the matrices are block-quantized (Q4_1/Q4_K/Q5_0/Q6_K/Q8_0) and the vectors F32; a
dequantized block value ``d * q + m`` (f16 ``d``/``m``) is in general not a bfloat16 (nor a
float16) number, so the matrices are the float32 dequantization rounded to nearest-even
bfloat16, exactly what serving in bfloat16 did with the version-1 float32 files, while the F32
vectors stay exact. The marker records how many matrix values the rounding changed. Format
version 1 (everything float32, no ``format_version`` in the marker) is pulled again on the
next :func:`kvmesh.hub.pull.resolve_model` (or, if that fails, e.g. offline, still served as it is).
torch and transformers are imported only inside these functions.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib
import sys

from kvmesh.hub.manifest import ModelSpec
from kvmesh.core.errors import EngineError

_FLOAT_GGML = ("F64", "F32", "F16")   # GGML types bfloat16 cannot hold exactly (BF16 can)


def gguf_tensor_types(gguf_path: pathlib.Path) -> dict[str, int]:
    """``{"<GGML type> <n>d": count}`` over the GGUF's tensors (n = dimensions of size > 1),
    e.g. ``{"F32 1d": 61, "Q4_1 2d": 210, "Q8_0 2d": 1}``. Reads the header only."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        key = f"{t.tensor_type.name} {sum(int(d) > 1 for d in t.shape)}d"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


@contextlib.contextmanager
def _quiet_transformers(progress: bool):
    """transformers' GGUF path at error verbosity (it warns about every untouched config
    default), its progress bars off unless ``progress``; everything restored on exit."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    old_verbosity = hf_logging.get_verbosity()
    gguf_utils = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf_utils is None:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if not progress:
        hf_logging.disable_progress_bar()
        if gguf_tqdm is not None:  # the GGUF dequantization bar is a plain tqdm
            gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(old_verbosity)


def _save_tokenizer(spec: ModelSpec, gguf_path: pathlib.Path, out: pathlib.Path):
    """The GGUF's tokenizer (with its chat template) saved into ``out``; returns it. Raises
    EngineError when the GGUF carries no chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template:
        raise EngineError(f"pulling {spec.name}: the GGUF carries no tokenizer.chat_template")
    tok.save_pretrained(str(out))
    return tok


def write_serving_files(spec: ModelSpec, gguf_path: pathlib.Path, out: pathlib.Path, progress: bool) -> None:
    """Write into directory ``out`` (created) what serving ``gguf_path`` as it is needs beside it:
    config.json from the GGUF's metadata (transformers' ``AutoConfig`` with ``gguf_file``; no
    tensor is read), the tokenizer with its chat template, and generation_config.json
    (:func:`fix_config_files`). The config equals the one :func:`convert` writes for the same
    GGUF but for its ``dtype`` entry. Raises EngineError when the GGUF carries no chat template."""
    from transformers import AutoConfig

    with _quiet_transformers(progress):
        cfg = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        cfg.architectures = [spec.hf_architecture]
        out.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(str(out))
        tok = _save_tokenizer(spec, gguf_path, out)
    fix_config_files(spec, out, tok)


def convert(spec: ModelSpec, gguf_path: pathlib.Path, out: pathlib.Path, progress: bool) -> dict:
    """Dequantize ``gguf_path`` to a Hugging Face directory ``out`` (created): the files of
    :func:`write_serving_files` plus the weights in ``*.safetensors``, matrices
    bfloat16, vectors float32 (this module's docstring). Returns facts for the marker:
    ``gguf_tensor_types`` (:func:`gguf_tensor_types`), ``matrix_values`` (number of matrix
    elements) and ``matrix_values_rounded`` (how many of them bfloat16 cannot hold exactly).
    Raises EngineError when the GGUF stores a matrix as F32/F16/F64 (bfloat16 would round
    it) or transformers' GGUF support is missing."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:  # transformers' GGUF loader insists on it
        raise EngineError(f"converting {spec.name}: dequantizing GGUF weights needs the 'accelerate' "
                          "package (pip install accelerate)")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    types = gguf_tensor_types(gguf_path)
    float_matrices = {k: n for k, n in types.items() if k.split()[0] in _FLOAT_GGML and k.split()[1] != "1d"}
    if float_matrices:
        raise EngineError(f"converting {spec.name}: the GGUF stores matrices in float precision "
                          f"({float_matrices}); bfloat16 storage would round them")
    with _quiet_transformers(progress):
        src, fname = str(gguf_path.parent), gguf_path.name
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, **{dtype_kw: torch.float32})
        # The GGUF quantizer stays attached after dequantizing; saving with it would record a
        # quantization_config that makes the directory look quantized.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        for attr in ("is_quantized", "quantization_method"):
            if attr in vars(model):
                with contextlib.suppress(AttributeError, TypeError):
                    delattr(model, attr)
        model.config.architectures = [spec.hf_architecture]
        # Storage precision (this module's docstring), one tensor at a time so that the float32 copy
        # of each matrix is freed as it goes; a tied lm_head is the same Parameter.
        matrix_values = rounded = 0
        for p in model.parameters():
            if p.dim() >= 2:
                b = p.data.to(torch.bfloat16)
                for rb, rf in zip(b.split(1024), p.data.split(1024)):   # no float32 temp of the whole matrix
                    rounded += int((rb.float() != rf).sum())
                matrix_values += p.numel()
                p.data = b
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out), safe_serialization=True)
        del model
        tok = _save_tokenizer(spec, gguf_path, out)

    fix_config_files(spec, out, tok)
    return {"gguf_tensor_types": types, "matrix_values": matrix_values, "matrix_values_rounded": rounded}


def fix_config_files(spec: ModelSpec, out: pathlib.Path, tok) -> None:
    """Make the saved files self-describing for readers other than transformers 5:
    no quantization_config, a top-level rope_theta, the chat template in tokenizer_config.json,
    and generation_config.json with the model's eos ids."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg["architectures"] = [spec.hf_architecture]
    if "_model_name_or_path" in cfg:  # transformers copies the GGUF's general.name here
        cfg["_model_name_or_path"] = spec.hf_repo
    eos_ids = [tok.eos_token_id]
    # Qwen2.5 instruct models stop on <|im_end|> (the GGUF's eos) and also on <|endoftext|>.
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(eot, int) and eot not in eos_ids and eot != tok.unk_token_id:
        eos_ids.append(eot)
    cfg["eos_token_id"] = eos_ids[0]
    if tok.bos_token_id is not None:
        cfg["bos_token_id"] = tok.bos_token_id
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    tc["chat_template"] = tok.chat_template
    # transformers 5 writes its own class name and load-time flags; PreTrainedTokenizerFast
    # loads the same tokenizer.json in transformers 4 and 5 (and in other engines).
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):
        tc.pop(key, None)
    if cfg.get("max_position_embeddings"):
        tc["model_max_length"] = cfg["max_position_embeddings"]
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")

    gen: dict = {"eos_token_id": eos_ids if len(eos_ids) > 1 else eos_ids[0]}
    if tok.bos_token_id is not None:
        gen["bos_token_id"] = tok.bos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[-1]
    gen["pad_token_id"] = pad
    gen["_from_model_config"] = False
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():  # safetensors are written 0600; make the cache readable like any file
        if f.is_file():
            f.chmod(0o666 & ~umask)


def check_output(spec: ModelSpec, out: pathlib.Path) -> None:
    """Sanity-check the serving files of a pulled directory (:func:`write_serving_files`):
    raise EngineError when the config names another architecture or keeps a
    quantization_config, or the tokenizer has no eos token or chat template."""
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(str(out))
    if (cfg.architectures or [None])[0] != spec.hf_architecture:
        raise EngineError(f"pulling {spec.name}: converted config names {cfg.architectures}, "
                          f"expected {spec.hf_architecture}")
    if getattr(cfg, "quantization_config", None):
        raise EngineError(f"pulling {spec.name}: converted config still has a quantization_config")
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    if tok.eos_token_id is None or not ids:
        raise EngineError(f"pulling {spec.name}: converted tokenizer has no eos token or chat template")


def check_dense(spec: ModelSpec, out: pathlib.Path) -> None:
    """Sanity-check the dense weights :func:`convert` wrote into ``out``: raise EngineError when
    there is no ``*.safetensors`` or a tensor is not bfloat16 (matrices) / float32 (vectors)."""
    files = list(out.glob("*.safetensors"))
    if not files:
        raise EngineError(f"converting {spec.name}: no safetensors written")
    wrong = [f"{k} {d}" for k, d, shape in stored_tensors(files) if d != ("BF16" if len(shape) >= 2 else "F32")]
    if wrong:
        raise EngineError(f"converting {spec.name}: expected bfloat16 matrices and float32 vectors, "
                          f"got {wrong[:5]}")


def stored_tensors(files: list[pathlib.Path]) -> list[tuple[str, str, list[int]]]:
    """``(name, safetensors dtype such as "BF16", shape)`` of every tensor in ``files``
    (headers only; no tensor data is read)."""
    from safetensors import safe_open

    found = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                found.append((k, sl.get_dtype(), list(sl.get_shape())))
    return found

