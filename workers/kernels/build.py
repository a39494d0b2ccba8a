"""The one build of kvmesh's native CPU kernels: where it is cached, who builds it, how it loads.

``make venv`` runs ``python -m workers.kernels.build``, which compiles every source under
``csrc/`` into one library (all five kernel paths, scalar to AMX, are in it: each path's
translation units are compiled with ``#pragma GCC target`` and chosen at run time, so nothing is
built for this CPU alone) and leaves it in the cache::

    kvmesh_home()/torch_extensions/
        kvmesh_kernels-<key>/kvmesh_kernels.so    the library (nothing else is kept)
        kvmesh_kernels-<key>/build.json           written last: what was built, from what, how long
        kvmesh_kernels-<key>.lock                 the build lock (flock), naming its holder

``key`` hashes the sources (their names relative to ``csrc/`` and their bytes), the compiler and
linker flags, the torch and Python versions and the machine: nothing else. Every checkout,
worktree or CI clone of the same sources, through any path to any virtual environment with the
same torch, finds the same build, and a start loads it without running the compiler or ninja.
An editable checkout whose sources changed has a new key and builds once, at its first use
(:func:`load`), with one line on stderr saying so.

Builders are serialized per key by an exclusive ``flock`` on ``<dir>.lock``; the kernel drops it
when its holder dies, and a build directory without ``build.json`` (a build that was killed) is
deleted and built again by the next holder, so an interrupted build never stalls a later start.
A process that finds the lock held says so on stderr (the holder's pid, command and how long it
has been building) and waits at most ``KVMESH_KERNEL_BUILD_WAIT`` seconds (default
:data:`DEFAULT_WAIT_S`), then raises :class:`~kvmesh.core.errors.DependencyUnavailableError`.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from types import ModuleType

from kvmesh.core.errors import DependencyUnavailableError, SettingsError
from kvmesh.hub.cache import kvmesh_home

DEFAULT_WAIT_S = 600.0      # seconds: above the slowest cold build measured (docs/engine.md, "Attention backends")
RECORD = "build.json"


@dataclasses.dataclass(frozen=True)
class Extension:
    """A C++ torch extension built from every ``.cpp`` under ``source_dir`` (``.h`` files count
    for the key).

    Attributes:
        name: the library's and Python module's name (``TORCH_EXTENSION_NAME``).
        source_dir: the sources' root.
        include_dirs: ``-I`` directories, relative to ``source_dir``.
        cflags, ldflags: compiler and linker flags, beyond torch's own.
    """

    name: str
    source_dir: Path
    include_dirs: tuple[str, ...] = (".",)
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()

    def sources(self) -> list[Path]:
        """The ``.cpp`` and ``.h`` files under ``source_dir``, sorted."""
        return sorted(p for p in self.source_dir.rglob("*") if p.suffix in (".cpp", ".h") and p.is_file())

    def key(self) -> str:
        """24 hex digits of SHA-256 over the sources' relative names and bytes, the flags, the
        include directories (relative), torch's and Python's versions and the machine. The
        checkout's path and the interpreter's path are not in it."""
        import torch
        h = hashlib.sha256()
        for p in self.sources():
            h.update(p.relative_to(self.source_dir).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
        h.update(json.dumps([self.name, list(self.include_dirs), list(self.cflags), list(self.ldflags),
                             torch.__version__, sys.implementation.cache_tag, platform.machine()]).encode())
        return h.hexdigest()[:24]

    def directory(self) -> Path:
        """``kvmesh_home()/torch_extensions/<name>-<key>`` (may not exist yet)."""
        return kvmesh_home() / "torch_extensions" / f"{self.name}-{self.key()}"

    def library(self) -> Path:
        """The built library's path, ``directory()/<name>.so``."""
        return self.directory() / f"{self.name}.so"


_CSRC = Path(__file__).parent / "csrc"
KERNELS = Extension("kvmesh_kernels", _CSRC, include_dirs=(".", "gemm"),
                    cflags=("-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi"), ldflags=("-fopenmp",))
"""kvmesh's kernels: every source under ``workers/kernels/csrc`` (attention, KV writes, norms,
GEMMs), one library with every ISA path."""


@dataclasses.dataclass
class Loaded:
    """What :func:`load` did: the imported ``module``, its ``directory``, whether this call
    ``compiled`` it and in how many ``seconds`` (0 when it did not)."""

    module: ModuleType
    directory: Path
    compiled: bool
    seconds: float


def is_built(ext: Extension = KERNELS) -> bool:
    """True when ``ext``'s current sources have a complete build in the cache (its record is there)."""
    return (ext.directory() / RECORD).is_file()


def wait_bound_s() -> float:
    """How long a start waits for another process's build: ``KVMESH_KERNEL_BUILD_WAIT`` seconds,
    default :data:`DEFAULT_WAIT_S`. Raises SettingsError for a value that is not a number >= 0."""
    raw = os.environ.get("KVMESH_KERNEL_BUILD_WAIT", "")
    if not raw:
        return DEFAULT_WAIT_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v >= 0:
        raise SettingsError(f"KVMESH_KERNEL_BUILD_WAIT={raw!r}: want seconds, a number >= 0")
    return v


def load(ext: Extension = KERNELS, wait_s: float | None = None) -> Loaded:
    """Import ``ext``'s library from the cache; build it first when its sources have no complete
    build (compiler and ninja run only then).

    Args:
        wait_s: the most seconds to wait for another process holding the build lock (None:
            :func:`wait_bound_s`).
    Raises:
        DependencyUnavailableError: another process held the build lock for ``wait_s`` seconds.
        Exception: what the compiler or the import raised (``RuntimeError`` for a failed build,
            ``ImportError`` for a library that does not load).
    """
    d = ext.directory()
    if (d / RECORD).is_file():
        return Loaded(_import(ext, d), d, False, 0.0)
    with _BuildLock(d, wait_bound_s() if wait_s is None else wait_s):
        if (d / RECORD).is_file():           # built by the process we waited for
            return Loaded(_import(ext, d), d, False, 0.0)
        _say(f"compiling the native CPU kernels ({ext.name}) for these sources, once (1-2 minutes on 2 cores, "
             f"longer when they are busy; `make venv` does it ahead of time), into {d}")
        return _compile(ext, d)


def _import(ext: Extension, d: Path) -> ModuleType:
    path = d / f"{ext.name}.so"
    spec = importlib.util.spec_from_file_location(ext.name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} (delete {d} to build it again)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise ImportError(f"{e} (delete {d} to build it again)") from e
    return module


def _compile(ext: Extension, d: Path) -> Loaded:
    """Build into ``d`` (the caller holds its lock): whatever an interrupted build left there
    goes first; only the library and the record stay."""
    from torch.utils import cpp_extension
    import torch

    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    sources = _digests(ext)
    t0 = time.monotonic()
    try:
        module = cpp_extension.load(
            name=ext.name, sources=[str(p) for p in ext.sources() if p.suffix == ".cpp"],
            extra_cflags=list(ext.cflags), extra_ldflags=list(ext.ldflags),
            extra_include_paths=[str(ext.source_dir / i) for i in ext.include_dirs],
            build_directory=str(d), verbose=False)
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    seconds = time.monotonic() - t0
    if _digests(ext) != sources:             # edited while compiling: the library is not this key's
        shutil.rmtree(d, ignore_errors=True)
        raise RuntimeError(f"the kernel sources in {ext.source_dir} changed during the build; run it again")
    lib = f"{ext.name}.so"
    for p in d.iterdir():                    # objects, build.ninja (it names this checkout's paths)
        if p.name != lib:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    record = {"name": ext.name, "key": d.name.rsplit("-", 1)[1], "torch": torch.__version__,
              "python": sys.implementation.cache_tag, "machine": platform.machine(),
              "cflags": list(ext.cflags), "ldflags": list(ext.ldflags), "source_dir": str(ext.source_dir),
              "sources": sources,
              "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "build_seconds": round(seconds, 1),
              "built_by": {"pid": os.getpid(), "argv": sys.argv}}
    tmp = d / f"{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, d / RECORD)
    _say(f"compiled the native CPU kernels in {seconds:.0f} s: {d}")
    return Loaded(module, d, True, seconds)


def _digests(ext: Extension) -> dict[str, str]:
    """{source name relative to ``source_dir``: sha256 of its bytes}."""
    return {p.relative_to(ext.source_dir).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in ext.sources()}


class _BuildLock:
    """The exclusive ``flock`` on ``<d>.lock`` that one build holds. Waiting for it prints one
    line on stderr naming the holder and is bounded by ``wait_s`` seconds (then
    DependencyUnavailableError). The holder writes its pid, host, command and start time into
    the file and clears them when it is done, so a record found on entry names a build that
    was killed (the kernel released its lock); the new holder says it takes over."""

    def __init__(self, d: Path, wait_s: float, poll_s: float = 0.25):
        self.path = d.with_name(d.name + ".lock")
        self.dir = d
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.fd = -1

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        t0 = time.monotonic()
        told = False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - t0
                holder = _holder_text(self.path)
                if not told:
                    _say(f"waiting for {holder} to finish building the native CPU kernels into {self.dir}; "
                         f"giving up after {self.wait_s:.0f} s (KVMESH_KERNEL_BUILD_WAIT)")
                    told = True
                if waited >= self.wait_s:
                    os.close(self.fd)
                    raise DependencyUnavailableError(
                        f"gave up after {waited:.0f} s waiting for {holder} to finish building the native CPU "
                        f"kernels into {self.dir} (lock {self.path}); wait for it or stop it, raise "
                        f"KVMESH_KERNEL_BUILD_WAIT, or run without the kernels: KVMESH_NATIVE_KERNELS=0") from None
                time.sleep(min(self.poll_s, max(self.wait_s - waited, 0.0)))
        if told:
            _say(f"the other build finished after {time.monotonic() - t0:.0f} s")
        left = _read_holder(self.path)
        if left:
            _say(f"taking over the native CPU kernels' build that {_describe(left)} left unfinished")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv, "since": time.time()}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(me).encode(), 0)
        return self

    def __exit__(self, *exc):
        os.ftruncate(self.fd, 0)             # finished (or failed cleanly): nothing left to take over
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        return False


def _read_holder(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None


def _describe(h: dict) -> str:
    cmd = " ".join(map(str, h.get("argv") or []))
    cmd = cmd if len(cmd) <= 120 else cmd[:117] + "..."
    host = "" if h.get("host") == socket.gethostname() else f" on {h.get('host')}"
    return f"pid {h.get('pid')}{host} ({cmd or '?'}, started {time.time() - float(h.get('since', time.time())):.0f} s ago)"


def _holder_text(path: Path) -> str:
    h = _read_holder(path)
    return _describe(h) if h else "another process"


def _say(msg: str) -> None:
    print(f"kvmesh: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.kernels.build``: build kvmesh's kernels into the cache unless they are
    there (``make venv`` runs it), load them, and check that every ISA path is in the library.
    Exit 0 when built or up to date, or when there is nothing to build (not x86-64,
    ``KVMESH_NATIVE_KERNELS=0``); 1 when the build fails (the compiler's error on stderr)."""
    argparse.ArgumentParser(prog="python -m workers.kernels.build", description=main.__doc__).parse_args(argv)
    from kvmesh.core.engine_config import KERNEL_LEVELS
    if os.environ.get("KVMESH_NATIVE_KERNELS", "1") == "0":
        _say("KVMESH_NATIVE_KERNELS=0: the native CPU kernels are not built")
        return 0
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _say(f"no native CPU kernels for {platform.machine()} (x86-64 only); kvmesh runs the PyTorch path")
        return 0
    try:
        got = load(KERNELS)
    except Exception as e:       # noqa: BLE001 - the compiler's message is the report
        print(f"kvmesh: error: building the native CPU kernels failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    m = got.module
    ran = [level for level in KERNEL_LEVELS if m.set_isa(level) == level]   # one above the CPU's is lowered
    m.set_isa("auto")
    where = "" if got.compiled else f"up to date: {got.directory}; "
    _say(f"native CPU kernels {where}paths {', '.join(KERNEL_LEVELS)} built in; this CPU runs {', '.join(ran)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
