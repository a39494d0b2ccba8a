"""``kvmesh bench ablation`` (bench/ablation.py): the rows as data, row selection, refused and
failing rows, and one real run with smollm2 (2 rows through real ``kvmesh serve`` processes,
with faithfulness answers through the gateway against an in-process reference)."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from bench import ablation as A
from bench import ablation_child
from bench import faithfulness


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    A.add_arguments(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_rows_cover_the_menu_with_a_symptom_each():
    keys = [r.key for r in A.ROWS]
    assert keys[:6] == ["naive", "kv-cache", "static", "continuous", "prefix-caching", "prefix-routing"]
    assert {"int8-weights", "int4-awq", "int4-rtn", "int8-kv", "fp8-kv", "spec-ngram", "spec-draft"} <= set(keys)
    assert len(set(keys)) == len(keys) and all(r.symptom and r.name for r in A.ROWS)
    assert A.ROWS[0].engine == {"weight_format": "none", "policy": "naive", "max_num_seqs": 1}
    assert A.ROWS[5].scheduler == {"replicas": 2, "routing": "prefix"}
    ref = A.ROWS[-1]                    # the reference runtime: row 5's settings without native kernels
    assert ref.key == "reference-runtime" and ref.engine["attention_backend"] == "torch"
    env = ablation_child._env({"model": "m", "attention_backend": "torch"}, {"replicas": 1}, ref.env)
    assert env["KVMESH_NATIVE_KERNELS"] == "0" and env["KVMESH_ATTENTION_BACKEND"] == "torch"


def test_select_rows():
    draft = next(i for i, r in enumerate(A.ROWS, 1) if r.needs_draft)
    assert [i for i, _ in A.select_rows(None, "")] == [i for i in range(1, len(A.ROWS) + 1) if i != draft]
    assert len(A.select_rows(None, "some-draft")) == len(A.ROWS)
    assert [(i, r.key) for i, r in A.select_rows(["5", "kv-cache"], "")] == [(5, "prefix-caching"), (2, "kv-cache")]
    assert [i for i, _ in A.select_rows(["1,3"], "")] == [1, 3]
    with pytest.raises(ValueError, match="unknown row 'nope'"):
        A.select_rows(["nope"], "")
    with pytest.raises(ValueError):
        A.select_rows(["99"], "")


def test_row_settings():
    args = _args(model="m", dtype="float32", threads=4, kv_cache_memory="1GiB", draft_model="d")
    engine, sched = A.row_settings(A.ROWS[5], args)           # 2 replicas share the threads
    assert sched == {"executor": "local", "replicas": 2, "routing": "prefix"}
    assert engine["num_threads"] == 2 and engine["enable_prefix_caching"] is True and engine["model"] == "m"
    engine, _ = A.row_settings(next(r for r in A.ROWS if r.key == "spec-draft"), args)
    assert engine["draft_model"] == "d" and engine["speculative_method"] == "draft" and "draft_num_layers" not in engine
    args.draft_num_layers = 6                                    # a self-speculative draft: the first 6 layers
    assert A.row_settings(next(r for r in A.ROWS if r.key == "spec-draft"), args)[0]["draft_num_layers"] == 6
    env = ablation_child._env({"model": "m", "enable_prefix_caching": False}, {"replicas": 2})
    assert env["KVMESH_MODEL"] == "m" and env["KVMESH_ENABLE_PREFIX_CACHING"] == "0"
    assert env["KVMESH_SCHEDULER_REPLICAS"] == "2" and "KVMESH_DTYPE" not in env   # the caller's is dropped


def test_refused_rows_are_not_available_without_running():
    args = _args()
    bad = A.Row("bad", "bad weights", "none", {"weight_format": "int3"})
    r = A.run_row(7, bad, args)
    assert r["available"] is False and "weight_format" in r["error"]
    r = A.run_row(13, next(r for r in A.ROWS if r.needs_draft), args)
    assert r == {**r, "available": False, "error": "needs --draft-model"}
    assert "not available: unknown weight_format" in A.table([A.run_row(7, bad, args)])


def test_ratios_are_to_the_first_available_row():
    def row(i, tps, ttft, rss):
        return {"index": i, "name": f"r{i}", "symptom": "s", "available": True, "server_peak_rss_bytes": rss,
                "kv_pool_bytes": 2**20, "kv_peak_used_bytes": 2**19,
                "load": {"output_throughput": tps, "median_ttft_ms": ttft, "p90_ttft_ms": ttft, "median_itl_ms": 10.0}}
    rows = [{"index": 1, "name": "x", "symptom": "s", "available": False, "error": "boom"},
            row(2, 10.0, 100.0, 2**30), row(3, 25.0, 50.0, 2**31)]
    A.add_ratios(rows)
    assert rows[1]["ratios"]["output_throughput"] == 1.0
    assert rows[2]["ratios"] == {"output_throughput": 2.5, "median_ttft_ms": 0.5, "p90_ttft_ms": 0.5,
                                 "median_itl_ms": 1.0, "server_peak_rss_bytes": 2.0}
    text = A.table(rows)
    assert "| 1 | x | not available: boom |" in text and "25.0 (2.50x)" in text and "2.00 (2.00x)" in text


def test_peak_rss_of_this_process():
    assert ablation_child.peak_rss(os.getpid()) > 10 * 2**20
    assert ablation_child.peak_rss(2**22 + 12345) is None           # no such process


@pytest.mark.quality
def test_ablation_smollm2_two_rows(smollm2_dir, tmp_path, capsys, monkeypatch):
    from kvmesh.cli import main

    # a third row whose engine fails to start: shown as not available, the table goes on
    broken = A.Row("broken", "broken model", "none", {"model": str(tmp_path / "no-such-model")})
    monkeypatch.setattr(A, "ROWS", [*A.ROWS, broken])
    out, md = tmp_path / "ablation.json", tmp_path / "bench.md"
    md.write_text("# Benchmarks\n\n## Ablation\n")
    argv = ["bench", "ablation", "--model", str(smollm2_dir), "--dtype", "float32", "--rows", "kv-cache", "5",
            str(len(A.ROWS)), "--num-prompts", "2", "--max-tokens", "4", "--faithfulness-questions", "2",
            "--faithfulness-chats", "1", "--faithfulness-max-tokens", "4", "--reference", str(tmp_path / "ref.json"),
            "--kv-cache-memory", "128MiB", "--threads", "1", "--out", str(out), "--markdown", str(md)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "+ KV cache, batch 1" in printed and "+ prefix caching" in printed and "not available" in printed
    res = json.loads(out.read_text())
    first, second, third = res["rows"]
    assert (first["index"], second["index"]) == (2, 5) and first["available"] and second["available"]
    assert third["available"] is False and third["error"]
    for r in (first, second):
        ld = r["load"]
        assert ld["completed"] == 2 and ld["failed"] == 0 and ld["total_output_tokens"] == 8
        assert ld["output_throughput"] > 0 and ld["median_ttft_ms"] > 0 and ld["median_itl_ms"] > 0
        assert r["server_peak_rss_bytes"] > 100 * 2**20            # at least the weights of smollm2
        assert 0 < r["kv_peak_used_bytes"] <= r["kv_pool_bytes"] <= 128 * 2**20
        # rows 2 and 5 only change scheduling: the reference's greedy answers exactly
        f = r["faithfulness"]
        assert f["agreement"] == 1.0 and f["gate"]["reference_only"] == f["gate"]["test_only"] == 0
        assert f["gate"]["verdict"] == "NO EVIDENCE"                # identical, but too few items to pass
        chat = [f"chat-conduct-1/{k}" for k in range(1, len(faithfulness.select_chats(1)[0]["turns"]) + 1)]
        assert [a["id"] for a in f["answers"]] == ["conduct-01", "sec-01", *chat]
        assert all(a["text"] for a in f["answers"])
        assert 0.0 <= f["accuracy"]["overall"]["accuracy"] <= 1.0
    assert first["ratios"]["output_throughput"] == 1.0
    assert second["ratios"]["output_throughput"] == pytest.approx(
        second["load"]["output_throughput"] / first["load"]["output_throughput"])
    assert second["prefix_cache_queries"] > 0                     # prefix caching on in row 5
    assert first["prefix_cache_queries"] == 0                     # and off in row 2
    text = md.read_text()
    assert json.loads((tmp_path / "ref.json").read_text())["max_tokens"] == 4      # the cached reference
    assert text.startswith("# Benchmarks") and A.MARK_BEGIN in text and "| 5 | + prefix caching |" in text
    assert main(["bench", "ablation", "--table", str(out)]) == 0
    assert "| 2 | + KV cache, batch 1 |" in capsys.readouterr().out


def test_markdown_block_is_replaced_in_place(tmp_path):
    from bench.markdown import replace_block
    p = tmp_path / "doc.md"
    replace_block(p, "<!-- b -->", "<!-- e -->", "one")                  # created
    assert p.read_text() == "<!-- b -->\none\n<!-- e -->\n"
    p.write_text("head\n" + p.read_text() + "tail\n")
    replace_block(p, "<!-- b -->", "<!-- e -->", "two\nlines")
    assert p.read_text() == "head\n<!-- b -->\ntwo\nlines\n<!-- e -->\ntail\n"


def test_results_convention_of_the_bench_modules(tmp_path, capsys):
    """bench/markdown.py: --out, --markdown, --table (the legacy names refused); the JSON, the
    saved rows of both shapes, the Command line and tables of a markdown block."""
    from bench import markdown as M

    p = argparse.ArgumentParser(exit_on_error=False)
    M.add_output_args(p, markers="x")
    args = p.parse_args(["--out", str(tmp_path / "r.json"), "--markdown", "d.md", "--table", "a", "b"])
    assert (args.out, args.markdown, args.table) == (str(tmp_path / "r.json"), "d.md", ["a", "b"])
    for legacy in ("--output", "--result-file", "--json", "--md"):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            p.parse_args([legacy, "x.json"])
    M.write_json(tmp_path / "a.json", [{"k": 1}])
    M.write_json(tmp_path / "b.json", {"meta": {}, "rows": [{"k": 2}]})
    M.write_json("", {"not": "written"})
    assert M.saved_rows([tmp_path / "a.json", tmp_path / "b.json"]) == [{"k": 1}, {"k": 2}]
    args.table = [str(tmp_path / "a.json")]
    assert M.print_saved_table(args, lambda rows: f"{len(rows)} rows") and capsys.readouterr().out == "1 rows\n"
    args.table = None
    assert not M.print_saved_table(args, lambda rows: "never")
    meta = M.run_meta(M.command_line("prog", ["--x", "a b"]), elapsed_s=1200, workload="w", cpu="c")
    assert meta["command"] == "prog --x 'a b'"
    md = tmp_path / "d.md"
    M.write_markdown(md, "<!-- b -->", "<!-- e -->", meta, M.md_table(("a", "b"), [(1, 2)]), "note")
    assert md.read_text() == (f"<!-- b -->\nCommand: `prog --x 'a b'` ({meta['date']}, c, 20 min; w)\n\n"
                              "| a | b |\n|---|---|\n| 1 | 2 |\n\nnote\n<!-- e -->\n")
