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
