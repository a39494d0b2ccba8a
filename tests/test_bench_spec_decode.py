"""``python -m bench.spec_decode`` end to end on its ``--quick`` setup (SmolLM2 drafting for
itself, each configuration in its own child process): warm prompt prefixes, one draft
configuration per ``--draft-vocab-size``, rows labelled by what varies, speedups against ``none``
and the JSON the results page reads."""

from __future__ import annotations

import json

import pytest

from bench import spec_decode


def test_quick_run_with_warm_prefixes_and_two_draft_vocabularies(tmp_path, capsys, smollm2_dir):
    out = tmp_path / "spec.json"
    rc = spec_decode.main(["--quick", "--configs", "none", "draft", "--questions", "2", "--poor-requests", "0",
                           "--max-tokens", "6", "--concurrency", "1", "--reps", "1", "--warm", "--k", "2",
                           "--draft-num-layers", "8", "--draft-vocab-size", "0", "1024",
                           "--max-model-len", "2048", "--threads", "1", "--out", str(out)])
    assert rc == 0
    saved = json.loads(out.read_text())
    rows = {r["config"]: r for r in saved["summary"]}
    assert list(rows) == ["none", "draft@0", "draft@1024"]
    for name, r in rows.items():
        assert r["workload"] == "policydesk" and r["warm"] is True and r["concurrency"] == 1
        assert r["output_tok_s"] > 0 and r["speedup"] == pytest.approx(r["output_tok_s"] / rows["none"]["output_tok_s"])
        assert (r["draft"] is None) == (name == "none")
    assert rows["none"]["acceptance_rate"] is None
    for name in ("draft@0", "draft@1024"):
        assert 0 <= rows[name]["acceptance_rate"] <= 1 and rows[name]["propose_s"] > 0, name
    assert saved["args"]["draft_vocab_size"] == [0, 1024]
    table = capsys.readouterr().out
    assert "| policydesk | 1 | draft@1024 |" in table
