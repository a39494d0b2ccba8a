"""Where pulled models live and when one counts as pulled.

::

    kvmesh_home()/models/<name>/
        model.gguf (the published file)  config.json  generation_config.json
        tokenizer.json  tokenizer_config.json  chat_template.jinja  special_tokens_map.json (maybe)
        model.safetensors     # only once the dense weights were asked for (kvmesh.hub.pull.ensure_dense)
        .kvmesh-complete      # written last: JSON record of the pull (MARKER)

A directory without the marker (a crashed or interrupted pull) never counts as pulled. The
marker's ``dense`` entry says whether the dense safetensors are there (:func:`has_dense`).
Storage precision of the dense weights is that of format 2 (:mod:`kvmesh.hub.convert`);
:data:`FORMAT_VERSION` 3 also keeps the published GGUF as ``model.gguf``; a marker without
``format_version`` is version 1 (everything float32).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import sys

from kvmesh.hub.manifest import get_spec

MARKER = ".kvmesh-complete"
GGUF_FILE = "model.gguf"
# 1: all float32; 2: matrices bfloat16, vectors float32 (kvmesh.hub.convert); 3: 2 + the GGUF kept
FORMAT_VERSION = 3


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


def models_root() -> pathlib.Path:
    """``kvmesh_home()/models``: one directory per pulled model (not created here)."""
    return kvmesh_home() / "models"


def model_dir(name: str) -> pathlib.Path:
    """Where the pulled directory of known model ``name`` lives:
    ``kvmesh_home()/models/<name>`` (it may not exist yet). Raises EngineError for an unknown name."""
    return models_root() / get_spec(name).name


def read_marker(path: pathlib.Path) -> dict | None:
    """The pull record in directory ``path``, or None when it is missing or unreadable."""
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def has_dense(marker: dict) -> bool:
    """Whether the pull record ``marker`` says its directory holds the dense safetensors: its
    ``dense`` entry; records without one (every pull before pulls kept the GGUF alone) do."""
    return bool(marker.get("dense", True))


def pulled_version(name: str) -> int | None:
    """The format version of the complete pull of the pinned GGUF in ``model_dir(name)``
    (1 for markers without ``format_version``), or None when there is none."""
    spec = get_spec(name)
    d = model_dir(spec.name)
    marker = read_marker(d)
    if not marker or marker.get("gguf_sha256") != spec.gguf_sha256 or not (d / "config.json").is_file():
        return None
    return int(marker.get("format_version", 1))


def is_pulled(name: str) -> bool:
    """True when ``model_dir(name)`` holds a complete pull of the pinned GGUF in the
    current :data:`FORMAT_VERSION` (its marker file exists, records the pinned GGUF's sha256
    and that version, and config.json is there). Raises EngineError for an unknown name."""
    return pulled_version(name) == FORMAT_VERSION


def write_marker(path: pathlib.Path, record: dict) -> None:
    """Write the pull record ``record`` as directory ``path``'s marker, atomically (a temporary
    file, fsync, :func:`os.replace`): a reader sees the old record or the new one, never half."""
    tmp = path / f"{MARKER}.tmp"
    with open(tmp, "w") as fh:
        json.dump(record, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / MARKER)


def dir_bytes(path: pathlib.Path) -> int:
    """Bytes of the files below ``path`` but its marker (what the marker's ``bytes`` records)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.name.startswith(MARKER))


@contextlib.contextmanager
def locked(path: pathlib.Path):
    """Hold an exclusive flock on ``path`` (created if missing) for the duration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def log(msg: str) -> None:
    """One ``kvmesh: <msg>`` line on stderr."""
    print(f"kvmesh: {msg}", file=sys.stderr, flush=True)
