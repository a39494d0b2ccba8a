"""A checkpoint that cannot be served fails at load with a message naming the problem."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.errors import EngineError
from scheduler.engine import LLMEngine
from workers.loader import load_model


@pytest.fixture
def ckpt(tiny_llama_dir, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, d)
    return d


def _edit_tensors(d, fn):
    f = next(d.glob("*.safetensors"))
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f))


def _edit_config(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


def _load(d):
    return load_model(d, dtype=torch.float32, device="cpu", max_positions=64)


def test_tiny_checkpoint_loads(ckpt):
    assert _load(ckpt).cfg.num_layers >= 2


def test_unknown_architecture(ckpt):
    _edit_config(ckpt, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(EngineError, match="unsupported architecture.*GPTNeoXForCausalLM"):
        _load(ckpt)


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(EngineError, match="lacks.*layers.1.mlp.down_proj"):
        _load(ckpt)


def test_shape_mismatch(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :-1].contiguous()
    _edit_tensors(ckpt, shrink)
    with pytest.raises(EngineError, match="o_proj.weight.*shape mismatch"):
        _load(ckpt)


def test_unexpected_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(EngineError, match="unexpected tensor.*mystery"):
        _load(ckpt)


def test_no_weight_files(ckpt):
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(EngineError, match="no \\*.safetensors"):
        _load(ckpt)


def test_engine_reports_the_load_error(ckpt):
    _edit_config(ckpt, architectures=["BertModel"])
    with pytest.raises(EngineError, match="unsupported architecture"):
        LLMEngine(EngineConfig(model=str(ckpt), kv_cache_memory=2**20))


# ---------------------------------------------------------------------------------------------
# memory while loading (real weights)

LOAD_RATIO = 1.3          # peak RSS growth while loading / served weight bytes
LOAD_SLACK = 16 * 2**20   # allocator noise (bytes)


def test_bfloat16_load_peak_memory(smollm2_dir):
    """Loading SmolLM2 in bfloat16 in a fresh process (bench/load_memory.py): VmHWM minus the
    RSS right before load_model, with the high-water mark reset there, is at most 1.3x the
    served weight bytes + 16 MiB. The weights are allocated once in their serving layout and
    the checkpoint is read one tensor at a time, so the growth is the weights plus the largest
    tensor in flight. Measured: 340 MB for 326 MB of weights (1.05x); the loader that built an
    float32 model and read the checkpoint through an mmap peaked at 3.7x."""
    import workers
    from bench.load_memory import run_child

    r = run_child(str(smollm2_dir), "bfloat16", max_positions=2048)
    assert r["code"] == workers.__file__                 # this checkout's loader was measured
    growth = r["peak_rss"] - r["baseline_rss"]
    assert growth >= 0.95 * r["weight_bytes"], r         # the window saw the weights arrive
    assert growth <= LOAD_RATIO * r["weight_bytes"] + LOAD_SLACK, r
    assert r["rss_after"] - r["baseline_rss"] <= 1.05 * r["weight_bytes"] + LOAD_SLACK, r   # one copy stays


def test_safetensors_reader_matches_safetensors(tmp_path):
    """SafetensorsFile (plain reads, no mmap) returns what safetensors returns, whole or by
    rows, in the stored dtype; a damaged file is an EngineError naming it."""
    from workers.checkpoint import SafetensorsFile
    g = torch.Generator().manual_seed(0)
    ts = {"a": torch.randn(7, 5, generator=g).bfloat16(), "b": torch.randn(3, generator=g),
          "c": torch.arange(12, dtype=torch.int8).reshape(2, 3, 2), "empty": torch.zeros(0, 4)}
    f = tmp_path / "x.safetensors"
    save_file(ts, str(f))
    with SafetensorsFile(f) as sf:
        assert sorted(sf.keys()) == sorted(ts) and "a" in sf and "z" not in sf
        for k, t in ts.items():
            got = sf.get(k)
            assert got.dtype == t.dtype and torch.equal(got, t), k
        assert torch.equal(sf.get("a", 2, 6), ts["a"][2:6]) and torch.equal(sf.get("c", 1), ts["c"][1:])
        with pytest.raises(ValueError, match="rows 5:9"):
            sf.get("a", 5, 9)
    f.write_bytes(f.read_bytes()[:-10])                      # cut short: offsets past the end
    with pytest.raises(EngineError, match="x.safetensors: not a valid safetensors file"):
        SafetensorsFile(f)
