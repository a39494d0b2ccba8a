"""The kernels' build and its cache (workers/kernels/build.py), on a tiny extension of the same
kind (one C++ file and a header, compiled in a second) in a private KVMESH_HOME, and on the real
kernels:

- the key names the sources and flags, not the checkout's path;
- a fresh cache builds once; the next start, through another path to the same venv (a symlinked
  .venv), compiles nothing (``torch.utils.cpp_extension.load`` made to raise there), and keeps
  only the library and its record;
- a build killed while holding the lock does not stall the next start: it takes over, saying so;
- a start that finds the lock held says so on stderr, naming the holder, and gives up after the
  bound with DependencyUnavailableError; it builds once the holder is gone;
- a source edited while it compiles leaves no build behind;
- the real kernels, once built (``make venv``), load in a new process without compiling.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvmesh.core.errors import DependencyUnavailableError, SettingsError
from workers.kernels import build

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler to build the test extensions with")

TINY_CPP = """
#include <Python.h>
#include "tiny.h"
#define KV_CAT2(a, b) a##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KV_STR2(a) #a
#define KV_STR(a) KV_STR2(a)
static PyModuleDef def = {PyModuleDef_HEAD_INIT, KV_STR(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC KV_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  PyObject* m = PyModule_Create(&def);
  if (m) PyModule_AddIntConstant(m, "answer", TINY_ANSWER);
  return m;
}
"""


def tiny_sources(root: Path, answer: int = 42) -> Path:
    src = root / "csrc"
    src.mkdir(parents=True)
    (src / "tiny.cpp").write_text(TINY_CPP)
    (src / "tiny.h").write_text(f"#define TINY_ANSWER {answer}\n")
    return src


def tiny(src: Path, name: str) -> build.Extension:
    return build.Extension(name, src, cflags=("-O1",))


# A child process: ``load`` the tiny extension (or hold its lock) and report as JSON on stdout.
CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from workers.kernels import build
    mode, name, src = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    ext = build.Extension(name, src, cflags=("-O1",))
    if mode == "no-compile":            # the compiler must not run: torch's JIT entry point raises
        from torch.utils import cpp_extension
        def refuse(*a, **k):
            raise AssertionError("cpp_extension.load called")
        cpp_extension.load = refuse
    if mode == "hold":                  # hold the build lock, leave a partial build, wait to be killed
        with build._BuildLock(ext.directory(), 0.0):
            ext.directory().mkdir(parents=True, exist_ok=True)
            (ext.directory() / "lock").write_text("")        # torch's baton, as a killed build leaves it
            print(json.dumps({"holding": True}), flush=True)
            time.sleep(float(sys.argv[4]))
        sys.exit(0)
    got = build.load(ext, wait_s=60)
    print(json.dumps({"compiled": got.compiled, "answer": got.module.answer, "dir": str(got.directory),
                      "prefix": sys.prefix}))
""")


def child(mode: str, ext: build.Extension, home: Path, *extra: str, python: str = sys.executable,
          wait: bool = True):
    env = dict(os.environ, KVMESH_HOME=str(home))
    args = [python, "-c", CHILD, mode, ext.name, str(ext.source_dir), *extra]
    if not wait:
        return subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def holding(ext: build.Extension, home: Path, seconds: float) -> subprocess.Popen:
    p = child("hold", ext, home, str(seconds), wait=False)
    line = p.stdout.readline()
    assert json.loads(line) == {"holding": True}, p.stderr.read()
    return p


def test_the_key_names_the_sources_and_flags_not_the_checkout(tmp_path):
    a, b = tmp_path / "a" / "csrc", tmp_path / "b" / "csrc"
    shutil.copytree(build.KERNELS.source_dir, a)
    shutil.copytree(build.KERNELS.source_dir, b)
    import dataclasses
    key = build.KERNELS.key()
    assert dataclasses.replace(build.KERNELS, source_dir=a).key() == key
    assert dataclasses.replace(build.KERNELS, source_dir=b).key() == key
    (b / "dispatch.h").write_text((b / "dispatch.h").read_text() + "\n")     # one header byte
    assert dataclasses.replace(build.KERNELS, source_dir=b).key() != key
    assert dataclasses.replace(build.KERNELS, cflags=build.KERNELS.cflags + ("-g",)).key() != key
    assert build.KERNELS.directory().name == f"kvmesh_kernels-{key}"


def test_a_fresh_cache_builds_once_and_the_next_start_compiles_nothing(tmp_path):
    home, ext = tmp_path / "home", tiny(tiny_sources(tmp_path / "checkout"), "kvmesh_test_once")
    first, err = child("load", ext, home)
    assert first["compiled"] and first["answer"] == 42
    assert "compiling the native CPU kernels" in err
    d = Path(first["dir"])
    assert d.parent == home / "torch_extensions" and sorted(p.name for p in d.iterdir()) == \
        ["build.json", "kvmesh_test_once.so"]
    record = json.loads((d / "build.json").read_text())
    assert set(record["sources"]) == {"tiny.cpp", "tiny.h"} and record["key"] == d.name.rsplit("-", 1)[1]
    # the same venv through a symlink (another sys.prefix, other torch include paths)
    link = tmp_path / "venv-link"
    link.symlink_to(Path(sys.prefix))
    python = link / "bin" / Path(sys.executable).name
    for py in (sys.executable, str(python)):
        again, err = child("no-compile", ext, home, python=py)
        assert again == dict(first, compiled=False, prefix=again["prefix"]) and "compiling" not in err, err
    assert again["prefix"] != first["prefix"]
    # a changed header is another build, in its own directory
    shutil.rmtree(tmp_path / "checkout")
    changed, _ = child("load", tiny(tiny_sources(tmp_path / "checkout", answer=7), ext.name), home)
    assert changed["compiled"] and changed["answer"] == 7 and changed["dir"] != first["dir"]


def test_a_build_killed_holding_the_lock_does_not_stall_the_next_start(tmp_path, monkeypatch):
    home, ext = tmp_path / "home", tiny(tiny_sources(tmp_path / "checkout"), "kvmesh_test_killed")
    monkeypatch.setenv("KVMESH_HOME", str(home))
    p = holding(ext, home, 600)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert (ext.directory() / "lock").exists() and not (ext.directory() / "build.json").exists()
    t0 = time.monotonic()
    got, err = child("load", ext, home)
    assert got["compiled"] and got["answer"] == 42
    assert f"taking over the native CPU kernels' build that pid {p.pid}" in err, err
    assert "waiting" not in err
    assert time.monotonic() - t0 < 60


def test_a_start_waiting_for_a_build_says_so_and_gives_up_after_the_bound(tmp_path, monkeypatch, capfd):
    home, ext = tmp_path / "home", tiny(tiny_sources(tmp_path / "checkout"), "kvmesh_test_held")
    monkeypatch.setenv("KVMESH_HOME", str(home))
    p = holding(ext, home, 600)
    try:
        t0 = time.monotonic()
        with pytest.raises(DependencyUnavailableError, match=f"gave up after 1 s waiting for pid {p.pid}"):
            build.load(ext, wait_s=1.0)
        assert 1.0 <= time.monotonic() - t0 < 10
        err = capfd.readouterr().err
        assert f"kvmesh: waiting for pid {p.pid} (" in err and "giving up after 1 s" in err, err
        assert "KVMESH_KERNEL_BUILD_WAIT" in err
        monkeypatch.setenv("KVMESH_KERNEL_BUILD_WAIT", "0.5")              # the bound from the environment
        with pytest.raises(DependencyUnavailableError):
            build.load(ext)
    finally:
        p.kill()
        p.wait(timeout=30)
    monkeypatch.setenv("KVMESH_KERNEL_BUILD_WAIT", "soon")
    with pytest.raises(SettingsError, match="KVMESH_KERNEL_BUILD_WAIT"):
        build.load(ext)


def test_a_waiting_start_builds_once_the_holder_is_done(tmp_path, monkeypatch, capfd):
    home, ext = tmp_path / "home", tiny(tiny_sources(tmp_path / "checkout"), "kvmesh_test_waits")
    monkeypatch.setenv("KVMESH_HOME", str(home))
    p = holding(ext, home, 1.0)            # exits cleanly after a second, having built nothing
    got = build.load(ext, wait_s=60)
    p.wait(timeout=30)
    err = capfd.readouterr().err
    assert got.compiled and got.module.answer == 42
    assert f"waiting for pid {p.pid}" in err and "the other build finished" in err
    assert "taking over" not in err                # it finished cleanly: nothing left behind


def test_the_kernels_load_without_compiling_once_built():
    """After ``make venv`` (or any start that built them), a new process loads the kernels
    without calling the compiler: torch's JIT entry point raises in it."""
    from workers import kernels
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason())
    assert build.is_built()
    code = ("from torch.utils import cpp_extension\n"
            "def refuse(*a, **k): raise AssertionError('cpp_extension.load called')\n"
            "cpp_extension.load = refuse\n"
            "from workers import kernels\n"
            "print(kernels.available(), kernels.unavailable_reason())")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["True", "None"], r.stderr
    assert "compiling" not in r.stderr


def test_a_source_edited_during_the_build_leaves_no_build(tmp_path, monkeypatch):
    """The library would not be the key's: nothing is kept, the next start builds again."""
    from torch.utils import cpp_extension
    home, src = tmp_path / "home", tiny_sources(tmp_path / "checkout")
    monkeypatch.setenv("KVMESH_HOME", str(home))
    ext = tiny(src, "kvmesh_test_edited")
    real = cpp_extension.load

    def load_then_edit(*a, **k):
        m = real(*a, **k)
        (src / "tiny.h").write_text("#define TINY_ANSWER 43\n")
        return m

    monkeypatch.setattr(cpp_extension, "load", load_then_edit)
    with pytest.raises(RuntimeError, match="changed during the build"):
        build.load(ext, wait_s=10)
    assert not any(p.is_dir() for p in (home / "torch_extensions").iterdir())     # no directory for either key
