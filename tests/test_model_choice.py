"""``python -m bench.model_choice`` (bench/model_choice.py): configuration parsing, the paired
gate of quantized rows against their model's dense row, the table, and one real run with
smollm2 on one item."""

from __future__ import annotations

import json

import pytest

from bench import model_choice as MC


def test_parse_configs():
    assert MC.parse_configs(None) == MC.CONFIGS
    assert MC.parse_configs(["m", "m:int4"]) == [("m", "none"), ("m", "int4")]
    with pytest.raises(ValueError, match="MODEL"):
        MC.parse_configs(["m:fp4"])
    # every known model is in the default list, dense first
    from kvmesh.hub.manifest import KNOWN_MODELS
    assert {m for m, _ in MC.CONFIGS} == set(KNOWN_MODELS)
    assert all(MC.CONFIGS[[m for m, _ in MC.CONFIGS].index(m)][1] == "none" for m, _ in MC.CONFIGS)


def _row(model, fmt, correct, available=True):
    from bench.faithfulness import accuracy_group
    items = [{"id": f"q{i}", "correct": c, "text": ""} for i, c in enumerate(correct)]
    g = accuracy_group(correct)
    return {"model": model, "weight_format": fmt, "available": available, "items": items,
            "accuracy": {"questions": g, "chat_turns": None, "overall": g}, "ttft_s": 1.5, "prompt_tokens": 1677,
            "demo_turn_s": 3.0, "demo_tokens": 40, "decode_tok_s": 20.0}


def test_quantized_rows_are_gated_against_their_models_dense_row():
    rows = [_row("a", "none", [True] * 10 + [False] * 10), _row("a", "int4", [False] * 10 + [False] * 10),
            _row("b", "none", [True] * 20), {"model": "b", "weight_format": "int8", "available": False, "error": "x|y"}]
    MC.add_gates(rows)
    assert "gate" not in rows[0] and "gate" not in rows[2]
    g = rows[1]["gate"]
    assert (g["reference_only"], g["test_only"], g["verdict"]) == (10, 0, "FAIL") and rows[1]["gate_reference"] == "a none"
    text = MC.table(rows)
    assert "| a | int4 | 0% [0-16] | - | 0% [0-16] | 10 / 0, 0.002: FAIL | 1.50 (1677) | 3.0 (40 tokens) | 20.0 |" in text
    assert "| b | int8 | not available: x/y |" in text


@pytest.mark.quality
def test_model_choice_smollm2_one_item(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "mc.json"
    md = tmp_path / "results.md"
    md.write_text("# Results\n")
    assert MC.main(["--configs", str(smollm2_dir), "--num-questions", "1", "--num-chats", "0", "--max-tokens", "8",
                    "--kv-cache-memory", "256MiB", "--out", str(out), "--markdown", str(md)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["available"], row.get("error")
    assert row["accuracy"]["overall"]["n"] == 1 and row["accuracy"]["chat_turns"] is None
    assert [i["id"] for i in row["items"]] == ["conduct-01"]
    assert row["prompt_tokens"] > 1000 and 0 < row["ttft_s"] < row["demo_turn_s"]
    assert 1 <= row["demo_tokens"] <= MC.DEMO_MAX_TOKENS and row["decode_tok_s"] > 0
    text = md.read_text()
    assert text.startswith("# Results") and MC.MARK_BEGIN in text and "| bf16 |" in text
    assert MC.main(["--configs", "m:int2"]) == 2
    assert "expected MODEL" in capsys.readouterr().err
