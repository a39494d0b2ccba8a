"""docs/results.md's generated tables (bench/results_page.py):

- the page is current: regenerating it from the repo's JSON files gives the committed text;
- every figure comes from its JSON: a changed figure in a copy of docs/ changes the page;
- a source must hold: its file exists, its history section cites it, names the CPU, shows the
  command (when the JSON records none); otherwise PageError;
- every link of the page into docs/results-history.md names one of its headings.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from bench import results_page as rp


def test_the_page_is_current():
    assert rp.is_current(), "docs/results.md is not what the JSON files give: run python -m bench.results_page"
    assert rp.main(["--check"]) == 0


def test_the_tables_read_the_json(tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(rp.DOCS, docs, ignore=shutil.ignore_patterns("plots"))
    f = docs / "peers_2026-12-04_zen5_smollm2_vllm.json"
    d = json.loads(f.read_text())
    c = next(c for c in d["comparisons"] if c["metric"] == "single request decode tok/s")
    c["kvmesh"] = 1234.5
    f.write_text(json.dumps(d))
    page = rp.render(docs)
    row = next(line for line in page.splitlines() if line.startswith("| single request decode tok/s") and
               "Zen 5" in line)
    assert f"| 1,234.5 | {rp.num(c['peer_value'])} | {1234.5 / c['peer_value']:.2f}x |" in row
    assert page != rp.render(rp.DOCS)


def _history():
    intro, sections = rp.read_history(rp.HISTORY.read_text())
    return intro, sections


def test_a_source_must_hold():
    intro, sections = _history()
    ok = rp.Source(("soak.json",), "6", "family 26 model 2")
    run = rp.read_run(ok, intro, sections)
    assert (run.cpu, run.date) == ("AMD EPYC Zen 5 (family 26 model 2)", "2026-12-02")
    assert run.command == json.loads((rp.DOCS / "soak.json").read_text())["command"]
    bad = [
        (rp.Source(("no_such_run.json",), "6", "family 26 model 2"), "missing"),
        (rp.Source(("soak.json",), "0z11", "family 26 model 2"), "does not cite"),
        (rp.Source(("soak.json",), "6", "family 25 model 17"), "does not name"),
        (rp.Source(("soak.json",), "6", "a machine nobody wrote down"), "does not describe"),
        (rp.Source(("serving.json",), "0s", "family 6 model 207", command="python -m bench.serving --made-up"),
         "does not show the command"),
        (rp.Source(("quant_smollm2.json",), "2", rp.NOV30, command=rp.QUESTIONS[3].sources[0].command),
         "no date"),
        (rp.Source(("soak.json",), "9", "family 26 model 2"), "not in"),
    ]
    for src, why in bad:
        with pytest.raises(rp.PageError, match=why):
            rp.read_run(src, intro, sections)


def test_cited_names_expand_brace_lists():
    text = "JSON: `docs/peers_2026-12-03c_zen5_{vllm,llamacpp}_{1,2}.json`, docs/soak.json and `..._fp32.json`"
    assert rp.cited(text) == {"peers_2026-12-03c_zen5_vllm_1.json", "peers_2026-12-03c_zen5_vllm_2.json",
                              "peers_2026-12-03c_zen5_llamacpp_1.json", "peers_2026-12-03c_zen5_llamacpp_2.json",
                              "soak.json", "..._fp32.json"}


def test_links_into_the_history_name_its_headings():
    _, sections = _history()
    anchors = {s.anchor for s in sections.values()}
    page = rp.PAGE.read_text()
    links = re.findall(r"\]\(results-history\.md#([^)]+)\)", page)
    assert links and set(links) <= anchors | {"where-kvmesh-loses"}
    assert "where-kvmesh-loses" in anchors
    for name in re.findall(r"\]\(([\w.-]+\.json)\)", page):
        assert (rp.DOCS / name).is_file(), name
    # the heading GitHub makes of a section with punctuation and code
    assert sections["2"].anchor == "2-quantization-python--m-benchquant"
    assert Path(rp.HISTORY).read_text().startswith("# Results: the dated history")
