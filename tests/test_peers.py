"""bench/peers (the peers comparison driver): the workload files and the report, without any
peer installed (setting up peers is not part of CI)."""

import json

from bench.peers import compare
from bench.peers.gguf import gguf_path, peers_home
from kvmesh.hub.cache import model_dir
from kvmesh.hub.manifest import KNOWN_MODELS


def test_workload_files_hold_the_same_requests_as_kvmesh_tokenizes_them(tmp_path):
    from transformers import AutoTokenizer

    d = model_dir("smollm2-135m-instruct")
    workload, prompts = compare.write_workload(d, 3, 5, tmp_path)
    w = [json.loads(line) for line in workload.read_text().splitlines()]
    p = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert [r["id"] for r in w] == [r["id"] for r in p] == ["pd-0", "pd-1", "pd-2"]
    assert all(r["max_tokens"] == 5 for r in w + p)
    tok = AutoTokenizer.from_pretrained(str(d))
    for wr, pr in zip(w, p):
        assert wr["messages"][0]["role"] == "system" and "PolicyDesk" in wr["messages"][0]["content"]
        text = tok.apply_chat_template(wr["messages"], tokenize=False, add_generation_prompt=True)
        assert pr["prompt"] == text
        assert pr["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
        assert 1300 < len(pr["prompt_token_ids"]) < 1800


def test_verdict_names_the_direction_for_rates_and_latencies():
    assert compare._verdict(200, 100, True) == "kvmesh wins x2.00"
    assert compare._verdict(50, 100, True) == "kvmesh LOSES x2.00"
    assert compare._verdict(3.0, 1.0, False) == "kvmesh LOSES x3.00"   # TTFT: lower is better
    assert compare._verdict(1.0, 1.02, False) == "even (within 5%)"


def test_report_rows_ratios_and_token_agreement():
    offline = {
        "kvmesh": {"throughput": [{"batch_size": 1, "output_tok_s": 30.0}, {"batch_size": 8, "output_tok_s": 90.0}],
                   "single": {"ttft_s": 0.5, "decode_tok_s": 40.0, "token_ids": [1, 2, 3, 4]}},
        "hf": {"throughput": [{"batch_size": 1, "output_tok_s": 20.0}, {"batch_size": 8, "output_tok_s": 60.0}],
               "single": {"ttft_s": 0.25, "decode_tok_s": 20.0, "token_ids": [1, 2, 9, 4]}},
        "vllm": {"peer": "vllm", "error": "not installed: run bash bench/peers/setup_vllm.sh"},
    }
    serve = {"kvmesh": {"median_ttft_ms": 100.0, "output_throughput": 50.0},
             "llamacpp": {"median_ttft_ms": 50.0, "output_throughput": 25.0}}
    rows = compare.comparisons(offline, serve)
    by = {(r["metric"], r["peer"]): r for r in rows}
    assert by[("offline output tok/s, B=8", "hf")]["ratio"] == 1.5
    assert by[("single request TTFT s (cold)", "hf")]["verdict"] == "kvmesh LOSES x2.00"
    assert by[("serving median_ttft_ms", "llamacpp")]["verdict"] == "kvmesh LOSES x2.00"
    assert by[("serving output_throughput", "llamacpp")]["verdict"] == "kvmesh wins x2.00"
    assert not any(r["peer"] == "vllm" for r in rows)
    md = compare.table(rows, offline, serve)
    assert "transformers: first 2 of 4 greedy tokens identical" in md
    assert "vllm: **not measured**: not installed" in md


def test_gguf_lives_under_peers_home_named_after_the_model(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_PEERS_HOME", str(tmp_path))
    assert peers_home() == tmp_path
    assert gguf_path("smollm2-135m-instruct") == tmp_path / "gguf" / KNOWN_MODELS["smollm2-135m-instruct"].gguf_name
    assert compare.peer_python("vllm") == tmp_path / "vllm-venv" / "bin" / "python"


def test_dense_peers_are_compared_with_kvmesh_dense_and_quantized_ones_with_its_defaults():
    def run(tok_s, ttft, ids, rss=2 ** 30, startup=1.0):
        return {"throughput": [{"batch_size": 1, "output_tok_s": tok_s / 4, "startup_s": startup},
                               {"batch_size": 8, "output_tok_s": tok_s, "peak_rss_bytes": rss}],
                "single": {"ttft_s": ttft, "decode_tok_s": tok_s / 2, "token_ids": ids, "peak_rss_bytes": rss / 2,
                           "startup_s": startup / 2}, "settings": {"fmt": tok_s}}

    offline = {"kvmesh": run(100.0, 1.0, [1, 2, 3]), "kvmesh-dense": run(60.0, 2.0, [1, 2, 3]),
               "ort-int4": run(50.0, 1.0, [1, 2, 3]), "ort-fp32": run(30.0, 4.0, [1, 5, 3]),
               "openvino-fp16": run(120.0, 1.0, [1, 2, 3]), "openvino-int4": {"peer": "openvino-int4", "error": "not built"},
               "vllm": run(40.0, 2.0, [1, 2, 3])}
    assert compare.reference("ort-fp32", offline) == "kvmesh-dense"
    assert compare.reference("openvino-fp16", offline) == "kvmesh-dense"
    assert compare.reference("vllm", offline) == "kvmesh-dense"
    assert compare.reference("ort-int4", offline) == "kvmesh"
    assert compare.reference("ort-fp32", {"kvmesh-dense": {"error": "exit 1"}}) == "kvmesh"
    by = {(r["metric"], r["peer"]): r for r in compare.comparisons(offline, {})}
    assert by[("offline output tok/s, B=8", "ort-int4")]["ratio"] == 2.0          # kvmesh 100 vs 50
    assert by[("offline output tok/s, B=8", "ort-fp32")]["ratio"] == 2.0          # kvmesh-dense 60 vs 30
    assert [by[("offline output tok/s, B=8", p)]["kvmesh_row"] for p in ("ort-int4", "ort-fp32", "vllm")] == \
        ["kvmesh", "kvmesh-dense", "kvmesh-dense"]
    assert by[("offline output tok/s, B=8", "ort-fp32")]["peer_label"] == "ONNX Runtime GenAI fp32"
    assert by[("offline output tok/s, B=8", "openvino-fp16")]["verdict"] == "kvmesh LOSES x2.00"
    assert by[("single request TTFT s (cold)", "ort-fp32")]["ratio"] == 0.5
    assert not any(r["peer"] == "openvino-int4" for r in by.values())
    md = compare.table(list(by.values()), offline, {})
    assert "| ONNX Runtime GenAI fp32 |" in md and "| OpenVINO GenAI fp16 |" in md
    assert "ONNX Runtime GenAI fp32: first 1 of 3 greedy tokens identical" in md
    assert "openvino-int4: **not measured**: not built" in md

    sysm = compare.systems(offline, {"kvmesh": {"output_throughput": 9.0, "model": "x"}})
    assert set(sysm) == {"kvmesh", "kvmesh-dense", "ort-int4", "ort-fp32", "openvino-fp16", "vllm"}
    k = sysm["kvmesh"]
    assert (k["out_tok_s"], k["out_tok_s_batch"], k["out_tok_s_by_batch"]) == (100.0, 8, {1: 25.0, 8: 100.0})
    assert (k["ttft_s"], k["decode_tok_s"], k["peak_rss_mib"], k["startup_s"]) == (1.0, 50.0, 1024.0, 1.0)
    assert k["serving"] == {"output_throughput": 9.0}
    assert sysm["ort-fp32"]["label"] == "ONNX Runtime GenAI fp32" and sysm["ort-fp32"]["settings"] == {"fmt": 30.0}


def test_converted_models_live_under_peers_home_by_format(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_PEERS_HOME", str(tmp_path))
    assert compare.peer_model_dir("ort", "smollm2-135m-instruct", "int4") == tmp_path / "ort-models" / "smollm2-135m-instruct-int4"
    assert compare.peer_model_dir("openvino", "m", "fp16") == tmp_path / "openvino-models" / "m-fp16"
