"""docs/results.md's current figures: one table per question, generated from the benchmarks' JSON
files in docs/ (``python -m bench.results_page``); docs/results-history.md is the dated log the
figures were reported in, with each run's set-up and reading.

Each question of :data:`QUESTIONS` names the runs that hold its current figures
(:class:`Source`: a run's JSON file, or the files of its rounds, the history section that
reports it and the command that made it). Every cell is a figure of a JSON file, or the ratio of
two figures of one file; nothing else is computed. The CPU and the date next to each row come
from the JSON where it records them (a date: ``created``, ``date``; a CPU: a family and model in
its ``cpu``), else from the history section: the CPU as the section names it (a ``family F model
M`` of :data:`CPUS`, or the machine's description, which must appear in the section or in the
history's introduction) and the date in the section's heading, or one that appears in the
section. The generator checks that the section cites the file and shows the command; a source
that does not hold raises :class:`PageError`.

Usage::

    python -m bench.results_page           # rewrite the block between the markers of docs/results.md
    python -m bench.results_page --check   # exit 1 (and say which question) when the page is not current

After a new run: put its JSON in docs/, its dated section at the top of docs/results-history.md,
point the question's :class:`Source` at them, and run the generator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from bench.markdown import md_table

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = DOCS / "results.md"
HISTORY = DOCS / "results-history.md"
BEGIN = "<!-- bench:results-page begin -->"
END = "<!-- bench:results-page end -->"

# "family F model M" (as /proc/cpuinfo and the history name a CPU) -> the name written in a row
CPUS = {
    "family 26 model 2": "AMD EPYC Zen 5 (family 26 model 2)",
    "family 25 model 17": "AMD EPYC Zen 4 (family 25 model 17)",
    "family 25 model 1": "AMD EPYC Zen 3 (family 25 model 1)",
    "family 23 model 1": "AMD EPYC Zen 1 (family 23 model 1)",
    "family 6 model 207": "Intel Xeon (family 6 model 207)",
    "family 6 model 167": "Intel Xeon, Sapphire Rapids class (family 6 model 167)",
}
NAMES = {"vllm": "vLLM-CPU", "llamacpp": "llama.cpp", "hf": "transformers"}


class PageError(ValueError):
    """A source that does not hold: a file missing, a section that does not cite it or show its
    command, a CPU or date the JSON and the section do not give."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One run's figures.

    Attributes:
        files: JSON files in docs/ (several: the rounds of one run; a cell shows them ``a / b``).
        section: the id of the history section that reports the run (``"0z11"``, ``"2"``).
        cpu: a key of :data:`CPUS` or a description of the machine; either must appear in the
            section (or, for a description, in the history's introduction).
        command: the command that wrote the files, as the section shows it (checked with
            whitespace and line continuations collapsed), for a JSON that records none (a
            recorded ``argv`` or ``command`` is shown instead).
        date: ``YYYY-MM-DD`` when neither the JSON nor the section's heading dates the run;
            must appear in the section (or the introduction).
        note: a word on the run, after the source in its cell.
    """

    files: tuple[str, ...]
    section: str
    cpu: str
    command: str = ""
    date: str = ""
    note: str = ""


@dataclasses.dataclass
class Run:
    """A :class:`Source` read: its JSON documents (one per file), CPU, date and command."""

    source: Source
    data: list
    cpu: str
    date: str
    command: str
    cell: str          # the markdown of the source cell: file links, section link

    @property
    def first(self):
        return self.data[0]


@dataclasses.dataclass(frozen=True)
class Question:
    """A table of the page: ``title`` (its heading), ``intro`` (one paragraph: what the rows
    measure), ``header`` (its columns but the last three: CPU, date, source) and ``rows``:
    (a :class:`Run`) -> the rows' leading cells, one call per source."""

    title: str
    intro: str
    header: tuple[str, ...]
    sources: tuple[Source, ...]
    rows: Callable[[Run], list[list[str]]]


# ---- the history: sections, anchors ---------------------------------------------------------------

@dataclasses.dataclass
class Section:
    id: str
    heading: str
    text: str       # heading and body, up to the next "## "

    @property
    def anchor(self) -> str:
        """GitHub's anchor of the heading: lower case, punctuation dropped, spaces to hyphens."""
        s = re.sub(r"[^\w\- ]", "", self.heading.lower())
        return s.replace(" ", "-")


def read_history(text: str) -> tuple[str, dict[str, Section]]:
    """(the introduction: the text before the first section, {id: section}) of the history page."""
    parts = re.split(r"(?m)^## ", text)
    sections = {}
    for part in parts[1:]:
        heading = part.splitlines()[0].strip()
        sid = heading.split(".", 1)[0].strip()
        sections[sid] = Section(sid, heading, "## " + part)
    return parts[0], sections


def cited(text: str) -> set[str]:
    """The file names ``text`` mentions, brace lists expanded (``peers_{1,2}.json`` names
    ``peers_1.json`` and ``peers_2.json``; ``..._fp32.json`` after a name names nothing more)."""
    names = set()
    for m in re.finditer(r"[\w.{},/-]+\.json", text):
        todo = [m.group(0)]
        while todo:
            t = todo.pop()
            b = re.search(r"\{([^{}]*)\}", t)
            if b:
                todo += [t[:b.start()] + alt + t[b.end():] for alt in b.group(1).split(",")]
            else:
                names.add(t.rsplit("/", 1)[-1])
    return names


def _flat(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split())


# ---- reading a source -----------------------------------------------------------------------------

def read_run(src: Source, intro: str, sections: dict[str, Section], docs: Path = DOCS) -> Run:
    """Read ``src``'s files and establish its CPU, date and command (raises :class:`PageError`)."""
    sec = sections.get(src.section)
    if sec is None:
        raise PageError(f"history section {src.section!r} (for {src.files}) is not in {HISTORY.name}")
    data = []
    for f in src.files:
        path = docs / f
        if not path.is_file():
            raise PageError(f"{path} is missing")
        data.append(json.loads(path.read_text()))
        if f not in cited(sec.text):
            raise PageError(f"history section {src.section} does not cite docs/{f}")
    where = sec.text + "\n" + intro
    cpu = _json_cpu(data[0])
    if cpu is None:
        if src.cpu in CPUS:
            if src.cpu not in sec.text:
                raise PageError(f"history section {src.section} does not name {src.cpu!r}")
            cpu = CPUS[src.cpu]
        elif _flat(src.cpu) in _flat(where):
            cpu = src.cpu
        else:
            raise PageError(f"the history does not describe section {src.section}'s machine as {src.cpu!r}")
    date = _json_date(data[0]) or src.date
    if not date:
        m = re.search(r"\d{4}-\d{2}-\d{2}", sec.heading)
        if not m:
            raise PageError(f"no date for {src.files}: not in the JSON nor in section {src.section}'s heading")
        date = m.group(0)
    elif not _json_date(data[0]) and date not in where:
        raise PageError(f"history section {src.section} does not give the date {date}")
    command = _json_command(data[0])
    if command is None:
        if not src.command:
            raise PageError(f"{src.files[0]} records no command: give the source's command")
        if _flat(src.command) not in _flat(sec.text):
            raise PageError(f"history section {src.section} does not show the command {src.command!r}")
        command = src.command
    links = ", ".join(f"[{Path(f).name}]({f})" for f in src.files)
    cell = f"{links}; [history {src.section}]({HISTORY.name}#{sec.anchor})" + (f"; {src.note}" if src.note else "")
    return Run(src, data, cpu, date, command, cell)


def _json_cpu(d) -> str | None:
    """The CPU a JSON records, when it names a family and model (the name of :data:`CPUS`)."""
    if not isinstance(d, dict):
        return None
    for text in (d.get("cpu"), (d.get("meta") or {}).get("cpu") if isinstance(d.get("meta"), dict) else None):
        for key, name in CPUS.items():
            if isinstance(text, str) and key in text:
                return name
    return None


def _json_command(d) -> str | None:
    """The command a JSON records: ``argv`` (``bench.peers.compare``), ``command`` or ``meta.command``."""
    if not isinstance(d, dict):
        return None
    if isinstance(d.get("argv"), list):
        return "python -m bench.peers.compare " + shlex.join(d["argv"])
    meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
    for v in (d.get("command"), meta.get("command")):
        if isinstance(v, str) and v:
            return v
    return None


def _json_date(d) -> str | None:
    if not isinstance(d, dict):
        return None
    meta = d.get("meta") if isinstance(d.get("meta"), dict) else {}
    for v in (d.get("created"), d.get("date"), meta.get("date")):
        if isinstance(v, str) and re.match(r"\d{4}-\d{2}-\d{2}", v):
            return v[:10]
    return None


# ---- formatting -----------------------------------------------------------------------------------

def num(v: float | int | None, digits: int | None = None) -> str:
    """A figure as the tables print it: thousands separated; 1 decimal from 10 up, 2 from 1, 3
    below (or ``digits``); ``-`` for None."""
    if v is None:
        return "-"
    if isinstance(v, int) and digits is None:
        return f"{v:,}"
    if digits is None:
        digits = 1 if abs(v) >= 10 else 2 if abs(v) >= 1 else 3
    return f"{v:,.{digits}f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def rounds(values: list[str]) -> str:
    return " / ".join(values)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def acc(a: dict) -> str:
    lo, hi = a["ci"]
    return f"{pct(a['accuracy'])} [{100 * lo:.0f}-{100 * hi:.0f}]"


def gate_cells(g: dict | None) -> list[str]:
    if not g:
        return ["-", "-", "-"]
    lo, hi = g["difference_ci_points"]
    return [f"{g['reference_only']} / {g['test_only']}", f"{g['difference_points']:+.1f} [{lo:+.1f}, {hi:+.1f}]",
            f"**{g['verdict']}**"]


# ---- the questions --------------------------------------------------------------------------------

def _comparisons(run: Run, peer: str, keep: Callable[[str], str | None]) -> list[list[str]]:
    """Rows of ``bench.peers.compare`` comparisons against ``peer``: (metric, kvmesh, peer,
    kvmesh / peer) over the run's rounds; ``keep(metric)`` -> the metric's label, or None to skip."""
    by_metric: dict[str, list[dict]] = {}
    for d in run.data:
        for c in d["comparisons"]:
            if c["peer"] == peer and keep(c["metric"]) is not None:
                by_metric.setdefault(c["metric"], []).append(c)
    rows = []
    for metric, cs in by_metric.items():
        rows.append([keep(metric), run.first["model"], rounds([num(c["kvmesh"]) for c in cs]),
                     rounds([num(c["peer_value"]) for c in cs]),
                     rounds([ratio(c["kvmesh"], c["peer_value"]) for c in cs])])
    return rows


def engine_vs_vllm(run: Run) -> list[list[str]]:
    return _comparisons(run, "vllm", lambda m: m)


def vs_llamacpp(run: Run) -> list[list[str]]:
    if "loads" in run.first:                       # bench.serving: kvmesh serve vs llama.cpp's server
        return _serving(run, "llamacpp")
    return _comparisons(run, "llamacpp", lambda m: m[:-len(", gguf")] if m.endswith(", gguf") else None)


RUNTIME_METRICS = ("offline output tok/s", "single request TTFT s (cold)", "single request decode tok/s",
                   "peak RSS GiB", "start-up to ready s")
KVMESH_ROWS = {"kvmesh": "defaults (GGUF blocks)", "kvmesh-dense": "dense bf16", "kvmesh-gguf": "GGUF blocks"}


def every_runtime(run: Run) -> list[list[str]]:
    """Rows of a ``bench.peers.compare`` run against every peer it ran: (metric, model, peer,
    kvmesh's row, kvmesh, peer, kvmesh / peer); the offline rate at each batch size, the single
    request's TTFT and decode rate, peak RSS and start-up (the same-file rows of llama.cpp
    repeat kvmesh's defaults and are left out)."""
    rows = []
    for d in run.data:
        for c in d["comparisons"]:
            if c["metric"].endswith(", gguf") or not c["metric"].startswith(RUNTIME_METRICS):
                continue
            rows.append([c["metric"], d["model"], c.get("peer_label", NAMES.get(c["peer"], c["peer"])),
                         KVMESH_ROWS.get(c.get("kvmesh_row", "kvmesh"), c.get("kvmesh_row")), num(c["kvmesh"]),
                         num(c["peer_value"]), ratio(c["kvmesh"], c["peer_value"])])
    return rows


SERVING_METRICS = (("output tok/s", "output_throughput"), ("TTFT p90 ms", "p90_ttft_ms"),
                   ("TPOT p50 ms", "median_tpot_ms"))


def _serving(run: Run, peer: str) -> list[list[str]]:
    args = run.first["args"]
    loads = {"single": f"single ({args['num_prompts']} questions, {args['max_tokens']} tokens)",
             "chat": f"chat ({args['sessions']} sessions, {args['chat_max_tokens']} tokens per turn)"}
    rows = []
    for load, label in loads.items():
        if load not in run.first["loads"]:
            continue
        for name, key in SERVING_METRICS:
            k = [d["loads"][load]["kvmesh"][key] for d in run.data]
            p = [d["loads"][load][peer][key] for d in run.data]
            rows.append([f"{label}: {name}", args["model"], rounds([num(v) for v in k]), rounds([num(v) for v in p]),
                         rounds([ratio(a, b) for a, b in zip(k, p)])])
    return rows


def serving_vs_vllm(run: Run) -> list[list[str]]:
    return _serving(run, "vllm")


def quantization(run: Run) -> list[list[str]]:
    d = run.first
    if "batches" in d:                             # bench.kv_dtype_ab: KV cache formats
        med = {int(b): v["median_ms"] for b, v in d["batches"].items()}
        rows = []
        for kv in ("int8", "fp8"):
            b1 = med.get(1)
            more = ", ".join(f"batch {b}: {m[kv] / m['auto']:.3f}x" for b, m in sorted(med.items()) if b != 1)
            rows.append([d["model"], f"{kv} KV cache (bf16 weights)", "-",
                         f"step {num(b1[kv], 2)} ms, {b1[kv] / b1['auto']:.3f}x bf16 KV's" if b1 else "-",
                         f"step over bf16 KV's: {more}", "-", "-"])
        return rows
    rows = []
    for r in d["rows"]:
        rss = "-" if run.source.files[0] in NO_PEAK_RSS else num(r["peak_rss_bytes"] / 2 ** 30, 2)
        rows.append([_quant_model(run), f"{r['format']} ({r['dtype']})", num(r["weight_bytes"]),
                     num(r["decode_b1_tok_s"]), f"{num(r['decode_c_tok_s'])} ({r['concurrency']})",
                     num(r["ttft_s"], 2), rss])
    return rows


# runs whose peak RSS is the parent's, carried into each child by ru_maxrss (history section 2)
NO_PEAK_RSS = {"quant_qwen05.json"}


def _quant_model(run: Run) -> str:
    """The model of a ``bench.quant`` run, from its command (its JSON does not record it)."""
    return run.command.split("--model ", 1)[1].split()[0]


def spec_decode(run: Run) -> list[list[str]]:
    rows = []
    for s in run.first["summary"]:
        rows.append([f"{s['workload']}, concurrency {s['concurrency']}", s["target"], s["config"] +
                     (f" ({s['draft']})" if s.get("draft") else ""), num(s["decode_tok_s_p50"]),
                     num(s["output_tok_s"], 2), f"{s['speedup']:.2f}x",
                     "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.2f}"])
    return rows


def kv_tiers(run: Run) -> list[list[str]]:
    d = run.first
    base = {r["scenario"]: r for r in d["results"] if r["config"] == "recompute"}
    rows = []
    for r in d["results"]:
        b = base[r["scenario"]]
        rows.append([r["scenario"], r["config"], d["meta"]["model"] + f" ({d['meta']['dtype']})",
                     f"{num(r['ttft2_median'] * 1e3, 0)} / {num(r['ttft2_p90'] * 1e3, 0)}",
                     f"{b['ttft2_median'] / r['ttft2_median']:.1f}x / {b['ttft2_p90'] / r['ttft2_p90']:.1f}x",
                     num(r["bytes_loaded"] / d["meta"]["chats"] / 1e6, 1)])
    return rows


def quality(run: Run) -> list[list[str]]:
    d = run.first
    if "config" in d and "gate" in d:              # kvmesh eval faithfulness: one format against a reference
        c, ref = d["config"], d["reference_config"]
        return [[d["model"], f"{c['weight_format']}, {c['dtype']}", f"{ref['weight_format']}, {ref['dtype']}",
                 acc(d["accuracy"]["overall"]), acc(d["reference"]["accuracy"]["overall"]), *gate_cells(d["gate"])]]
    rows = []
    if d["rows"] and "weight_format" in d["rows"][0]:       # bench.model_choice: every model and format
        dense = {r["model"]: r for r in d["rows"] if r["weight_format"] == "none"}
        for r in d["rows"]:
            ref = dense.get(r["model"]) if r.get("gate") else None
            fmt = "bf16" if r["weight_format"] == "none" else r["weight_format"]
            rows.append([r["model"], f"{fmt}, bfloat16", "bf16, bfloat16" if ref else "-", acc(r["accuracy"]["overall"]),
                         acc(ref["accuracy"]["overall"]) if ref else "-", *gate_cells(r.get("gate"))])
        return rows
    model = re.search(r"--model (\S+)", d["meta"]["command"]).group(1)     # kvmesh bench ablation (paired gate)
    for r in d["rows"]:
        f = r.get("faithfulness") or {}
        if not f.get("gate"):
            continue
        rows.append([model, r["name"], "row 5's settings (dense bf16)", acc(f["accuracy"]["overall"]),
                     acc(f["reference_accuracy"]["overall"]), *gate_cells(f["gate"])])
    return rows


def soak(run: Run) -> list[list[str]]:
    d = run.first
    if "processes" in d:                           # a soak with every process's RSS (and chaos)
        return _chaos_soak(d)
    expected = sum(sum(v.values()) for v in d["outcomes"].values())
    return [
        ["requests (concurrency)", f"{num(d['requests'])} ({d['concurrency']}), {num(d['wall_s'], 0)} s"],
        ["answered as expected / unexpected", f"{num(expected)} / {d['unexpected']}"],
        ["KV blocks in use at the end (idle)", num(d["used_blocks_after"])],
        ["engine RSS outside the KV pool: after warm-up -> end",
         f"{num(d['engine_rss_without_kv_warm_mib'][0], 0)} -> {num(d['engine_rss_without_kv_end_mib'][0], 0)} MiB "
         f"({d['engine_rss_without_kv_growth_pct'][0]:+.1f}%)"],
        ["engine RSS, whole (the KV pool's pages become resident as the cache fills)",
         f"{num(d['engine_rss_warm_mib'][0], 0)} -> {num(d['engine_rss_end_mib'][0], 0)} MiB "
         f"({d['engine_rss_growth_pct'][0]:+.1f}%)"],
        ["`kvmesh serve` (gateway + scheduler) RSS",
         f"{num(d['serve_rss_warm_mib'], 0)} -> {num(d['serve_rss_end_mib'], 0)} MiB ({d['serve_rss_growth_pct']:+.1f}%)"],
    ]


def _chaos_soak(d: dict) -> list[list[str]]:
    """Rows of a ``bench.soak`` run that records every process (``processes``) and its chaos."""
    served = [a for a in d["serve_args"] if not a.startswith("redis://")]
    served = " ".join(a for a in served if a not in ("--kv-offload-redis-url", "--redis-url"))
    own = "--kv-offload-redis-url" in d["serve_args"]
    rows = [["requests (concurrency), wall time", f"{num(d['requests'])} ({d['concurrency']}), {num(d['wall_s'], 0)} s"],
            ["`kvmesh serve` flags", f"`{served}`" + (", the soak's own redis-server as KV tier and prefix index"
                                                       if own else "")]]
    chaos = d["chaos"]
    if "redis_restart" in chaos:
        r = chaos["redis_restart"]
        w = d["redis_window"]
        rows.append(["Redis killed (SIGKILL) and started again, empty",
                     f"at {num(r['done'])} requests done, down {r['t_up'] - r['t_down']:.1f} s; {w['requests']} "
                     f"requests open meanwhile: {w['expected_by'].get('kind', 0)} their kind's outcome, "
                     f"{w['expected_by'].get('unexpected', 0)} unexpected"])
    if "stage_kill" in chaos:
        k, w = chaos["stage_kill"], d["kill_window"]
        n = w["expected_by"]
        rows.append([f"stage {k['stage']} killed (SIGKILL), the replica restarted whole",
                     f"at {num(k['done'])} requests done, {k['in_flight']} in flight; back after {k['down_s']:.1f} s; "
                     f"{w['requests']} requests open meanwhile: {n.get('kind', 0)} their kind's outcome, "
                     f"{n.get('cut', 0)} UNAVAILABLE `replica 0 failed` after their first tokens, "
                     f"{n.get('waited', 0)} UNAVAILABLE after waiting `--restart-wait`, {n.get('unexpected', 0)} "
                     "unexpected"])
    hints = d["unavailable_retry_hints"]
    expected = sum(sum(v.values()) for v in d["outcomes"].values()) - d["unexpected"]
    rows += [["answered as expected / unexpected", f"{num(expected)} / {d['unexpected']}"
              + (f" (UNAVAILABLE: {hints.get('with retry hint', 0)} with a retry hint, {hints.get('without', 0)} "
                 "without)" if hints else "")],
             ["KV blocks in use at the end (idle)", num(d["used_blocks_after"])]]
    for p in d["processes"]:
        if not p["checked"]:
            continue
        when = "after warm-up" if p["baseline"] == "idle after warm-up" else "after the restart's warm-up"
        whole = (f"{num(p['rss_before_mib'], 0)} -> {num(p['rss_after_mib'], 0)} MiB "
                 f"({p['rss_growth_pct']:+.1f}%)")
        if not p["bounded"]:
            rows.append([f"{p['role']}: RSS, {when} -> end", whole])
            continue
        caches = [f"{name} {num(p[f'{key}_before_mib'], 0)} -> {num(p[f'{key}_after_mib'], 0)} MiB" for name, key in
                  (("KV pool", "kv_pool_rss"), ("host tier", "host_tier"), ("Ray object store pages", "object_store_rss"))
                  if p[f"{key}_after_mib"]]
        rows.append([f"{p['role']}: RSS outside its bounded caches ({p['bounded']}), {when} -> end",
                     f"{num(p['rest_before_mib'], 0)} -> {num(p['rest_after_mib'], 0)} MiB "
                     f"({p['rest_growth_pct']:+.1f}%); whole RSS {whole}: {', '.join(caches)}"])
    return rows


NOV30 = "AMD EPYC, AVX-512 with BF16/VNNI, AMX"     # the history's introduction: sections 1-4, 2026-11-30

QUESTIONS: tuple[Question, ...] = (
    Question(
        "kvmesh's engine against vLLM-CPU",
        "`bench.peers.compare`: the same PolicyDesk prompts through each system's own offline API (B = "
        "requests in flight), and one request alone (cold TTFT, decode at ~1.6k context), 2 threads each, "
        "SmolLM2-135M-Instruct in bf16; the latest run on each CPU. Ratios are kvmesh / vLLM (for TTFT, "
        "start-up and RSS lower is better).",
        ("metric", "model", "kvmesh", "vLLM-CPU", "kvmesh / vLLM"),
        (Source(("peers_2026-12-05_xeon_smollm2_openvino_vllm.json",), "0z22", "family 6 model 167",
                note="kvmesh's row is the dense bf16 conversion (its defaults, the GGUF blocks: section 0z22); "
                     "8 prompts, B=8 a prefill-bound pass"),
         Source(("peers_2026-12-04_xeon_qwen05_vllm.json",), "0z12", "family 6 model 167",
                note="kvmesh's row is its default, the GGUF blocks"),
         Source(("peers_2026-12-04_zen5_smollm2_vllm.json",), "0z11", "family 26 model 2",
                note="kvmesh's row is the dense bf16 conversion"),
         Source(("peers_2026-12-04_zen3_smollm2.json",), "0z10", "family 25 model 1",
                note="kvmesh's row is the dense bf16 conversion"),
         Source(("peers_2026-12-03_zen4.json",), "0y", "family 25 model 17"),
         Source(("peers_2026-12-02_emr.json",), "0", "family 6 model 207")),
        engine_vs_vllm),
    Question(
        "`kvmesh serve` against vLLM-CPU's OpenAI server",
        "`bench.serving`: the same PolicyDesk requests through `kvmesh serve` (its defaults) and vLLM-CPU's "
        "server, at most 8 single questions or 4 chat turns in flight, greedy, SmolLM2-135M-Instruct in "
        "bf16; the latest run on each CPU (two runs: `a / b`).",
        ("load: metric", "model", "kvmesh", "vLLM-CPU", "kvmesh / vLLM"),
        (Source(("serving_2026-12-05_zen4_smollm2_llamacpp.json",), "0z21", "family 25 model 17",
                command="python -m bench.serving --systems kvmesh,vllm,llamacpp"),
         Source(("serving_2026-12-03c_zen5_1.json", "serving_2026-12-03c_zen5_2.json"), "0z8", "family 26 model 2",
                command="python -m bench.serving --systems kvmesh,inprocess,vllm"),
         Source(("serving_2026-12-03_zen4.json",), "0y", "family 25 model 17",
                command="python -m bench.serving --systems kvmesh,inprocess,vllm"),
         Source(("serving.json",), "0s", "family 6 model 207", command="python -m bench.serving --out docs/serving.json")),
        serving_vs_vllm),
    Question(
        "kvmesh against llama.cpp on the same GGUF file",
        "`bench.peers.compare --peers llamacpp`: kvmesh serving the published GGUF blocks (`--weight-format "
        "gguf`, the default) and llama-cpp-python on the very same file, one request alone on a cold cache, "
        "2 threads each (rounds: `a / b / c`); and `bench.serving`'s chat load through `kvmesh serve` and "
        "llama.cpp's OpenAI server on that file. Ratios are kvmesh / llama.cpp.",
        ("metric", "model", "kvmesh", "llama.cpp", "kvmesh / llama.cpp"),
        (Source(("serving_2026-12-05_zen4_smollm2_llamacpp.json",), "0z21", "family 25 model 17",
                command="python -m bench.serving --systems kvmesh,vllm,llamacpp"),
         Source(("peers_2026-12-04_xeon_gguf_1p5b_1.json", "peers_2026-12-04_xeon_gguf_1p5b_2.json",
                 "peers_2026-12-04_xeon_gguf_1p5b_3.json"), "0z12", "family 6 model 167"),
         Source(("serving_2026-12-04_xeon_1p5b_llamacpp.json",), "0z12", "family 6 model 167",
                command="python -m bench.serving --model qwen2.5-coder-1.5b-instruct --systems kvmesh,llamacpp "
                        "--loads chat --sessions 4 --dtype auto"),
         Source(("peers_2026-12-04_zen5_gguf_1p5b_1.json", "peers_2026-12-04_zen5_gguf_1p5b_2.json"), "0z11",
                "family 26 model 2"),
         Source(("serving_2026-12-04_zen5_1p5b_llamacpp.json",), "0z11", "family 26 model 2",
                command="python -m bench.serving --model qwen2.5-coder-1.5b-instruct --systems kvmesh,llamacpp "
                        "--loads chat --dtype auto"),
         Source(("peers_2026-12-04_zen4_gguf_1p5b_1.json", "peers_2026-12-04_zen4_gguf_1p5b_2.json",
                 "peers_2026-12-04_zen4_gguf_1p5b_3.json"), "0z9", "family 25 model 17"),
         Source(("peers_2026-12-04_zen3_gguf_1p5b_1.json",), "0z10", "family 25 model 1"),
         Source(("peers_2026-12-04_zen3_smollm2.json",), "0z10", "family 25 model 1")),
        vs_llamacpp),
    Question(
        "kvmesh against every CPU runtime",
        "`bench.peers.compare --peers llamacpp,ort,openvino`: the same PolicyDesk prompts through llama.cpp (the "
        "GGUF file), ONNX Runtime GenAI (its model builder's fp32 and int4) and OpenVINO GenAI (optimum-intel's "
        "fp16 and int4 IRs), each peer against kvmesh in the comparable format: a dense peer against kvmesh's "
        "dense bf16 row, a quantized one against kvmesh's defaults (the GGUF blocks); 2 threads each, one run. "
        "Ratios are kvmesh / peer (for TTFT, start-up and RSS lower is better).",
        ("metric", "model", "peer", "kvmesh row", "kvmesh", "peer value", "kvmesh / peer"),
        (Source(("peers_2026-12-05_xeon_smollm2_openvino_vllm.json",), "0z22", "family 6 model 167"),
         Source(("peers_2026-12-05_xeon_1p5b_openvino.json",), "0z22", "family 6 model 167"),
         Source(("peers_2026-12-05_zen4_smollm2_cpu_runtimes.json",), "0z21", "family 25 model 17",
                note="its OpenVINO B=1 rows ran all 8 prompts in one generate() call, which the pipeline "
                     "batched (section 0z22): not a B=1 pass"),
         Source(("peers_2026-12-05_zen4_1p5b_cpu_runtimes.json",), "0z21", "family 25 model 17",
                note="OpenVINO's B=1 pass as above (2 prompts in one call)")),
        every_runtime),
    Question(
        "Quantization: bytes, speed and fit of each weight format, and the KV cache formats",
        "`bench.quant`: each weight format in its own process (in-process engine, greedy): weight bytes as "
        "stored, batch-1 decode tok/s, decode tok/s with N requests at once, TTFT of a 1.5k-token prompt, peak "
        "RSS; `bench.kv_dtype_ab`: the decode step over an int8 or fp8 KV cache against a bf16 one, engines "
        "interleaved in one process. The published GGUF blocks (the default format) are measured against "
        "llama.cpp above; their quality below.",
        ("model", "format (dtype)", "weight bytes", "decode b1 tok/s", "decode tok/s (concurrency)", "TTFT s",
         "peak RSS GiB"),
        (Source(("quant_smollm2.json",), "2", NOV30, date="2026-11-30",
                command="python -m bench.quant --model smollm2-135m-instruct --runs 3 --max-tokens 48 "
                        "--out docs/quant_smollm2.json"),
         Source(("quant_qwen05.json",), "2", NOV30, date="2026-11-30",
                command="python -m bench.quant --model qwen2.5-coder-0.5b-instruct --dtype bfloat16 --formats "
                        "none:float32 none:bfloat16 int8 int4 --runs 1 --max-tokens 32 --out docs/quant_qwen05.json",
                note="peak RSS not shown: this run recorded the parent's"),
         Source(("quant_fit.json",), "2", NOV30, date="2026-11-30",
                command="python -m bench.quant --model qwen2.5-coder-1.5b-instruct --memory-cap 5GiB "
                        "--kv-cache-memory 512MiB --formats none:float32 int4:bfloat16 --no-calibration --runs 1 "
                        "--max-tokens 16 --concurrency 4 --out docs/quant_fit.json",
                note="under a 5 GiB cap; dense float32 (6.62 GiB of weights) was not started"),
         Source(("kv_dtype_ab_2026-12-03_zen5.json",), "0z8", "family 26 model 2",
                command="python -m bench.kv_dtype_ab --kv-dtypes auto int8 fp8")),
        quantization),
    Question(
        "Speculative decoding",
        "`bench.spec_decode`: Qwen2.5-Coder-1.5B-Instruct with no speculation, `ngram` prompt lookup, a "
        "0.5B draft model and both (`ngram+draft`; k <= 4, adaptive), bf16, greedy, PolicyDesk questions "
        "(natural EOS; the 2026-12-05 runs with warm prompt prefixes; on the Xeon the draft's lm_head cut "
        "to its first 32,768 token ids, `--draft-vocab-size`, and its layers as published or requantized to "
        "Q4_1, `--draft-quantization`); decode tok/s = one request's rate after its first token (median), "
        "output tok/s = all output tokens over the wall time, speed-up = output tok/s over no speculation's "
        "(at concurrency 1 the issue's measure is decode tok/s: divide by the `none` row's).",
        ("workload", "target", "speculation", "decode tok/s", "output tok/s", "speed-up", "acceptance"),
        (Source(("spec_decode_2026-12-05_xeon_warm_cap5.json",), "0z19", "family 6 model 167",
                command="python -m bench.spec_decode --configs none ngram draft ngram+draft --questions 8 "
                        "--poor-requests 0 --max-tokens 96 --concurrency 1 8 --reps 1 --warm --draft-vocab-size "
                        "32768 --draft-quantization q4_1",
                note="the Q4_1 draft, speculation capped at 5 verified tokens per step (the default)"),
         Source(("spec_decode_2026-12-05_xeon_warm.json",), "0z19", "family 6 model 167",
                command="python -m bench.spec_decode --configs none ngram draft ngram+draft --questions 8 "
                        "--poor-requests 0 --max-tokens 96 --concurrency 1 8 --reps 1 --warm --draft-vocab-size "
                        "32768 --draft-quantization as-published q4_1",
                note="the draft as published and as Q4_1, the cap at its earlier 8"),
         Source(("spec_decode_2026-12-05_zen4_warm_native.json",), "0z18", "family 25 model 17",
                command="python -m bench.spec_decode --configs none draft ngram+draft --questions 8 "
                        "--poor-requests 0 --max-tokens 96 --concurrency 1 8 --reps 1 --warm",
                note="the draft as published with its whole vocabulary, the cap at 8"),
         Source(("spec_decode.json",), "3", NOV30, date="2026-11-30",
                command="python -m bench.spec_decode --questions 8 --max-tokens 64 --reps 1 --concurrency 1 8 "
                        "--poor-requests 2 --out docs/spec_decode.json"),),
        spec_decode),
    Question(
        "KV tiers: a returning chat's blocks from host memory or Redis",
        "`bench.kv_tiers`: the second turn of PolicyDesk chats after their blocks left the pool (`evicted`) "
        "or on another replica (`other-replica`), recomputed or loaded from the host tier or Redis; TTFT of "
        "that turn, the speed-up over recomputing it, and the KV loaded per turn.",
        ("scenario", "config", "model", "turn-2 TTFT median / p90 ms", "speed-up median / p90", "MB loaded per turn"),
        (Source(("kv_tiers_2026-12-03_zen4.json",), "0k", "family 25 model 17", date="2026-12-03",
                command="python -m bench.kv_tiers --chats 6 --out docs/kv_tiers_2026-12-03_zen4.json"),),
        kv_tiers),
    Question(
        "Quality per model and format: the paired gate on the whole PolicyDesk set",
        "Key-fact accuracy on the 212 PolicyDesk items (96 questions, 116 chat turns) with its 95% interval, "
        "and the paired gate against the reference named: items lost / gained, the difference in points "
        "with its 95% interval, and the verdict: PASS when the drop is shown to be at most 2 points, FAIL when the "
        "format is worse (p < 0.05) or more than 2 points below, NO EVIDENCE otherwise (docs/benchmarks.md, "
        "\"The paired gate\").",
        ("model", "format", "judged against", "accuracy", "reference's accuracy", "lost / gained",
         "difference, points [95%]", "verdict"),
        (Source(("faithfulness_gguf_2026-12-04_zen5_qwen15.json",), "0z11", "family 26 model 2",
                command="kvmesh eval faithfulness --model qwen2.5-coder-1.5b-instruct --weight-format gguf "
                        "--dtype bfloat16 --reference-dtype bfloat16"),
         Source(("faithfulness_gguf_2026-12-04_zen5_qwen05.json",), "0z11", "family 26 model 2",
                command="kvmesh eval faithfulness --model qwen2.5-coder-0.5b-instruct --weight-format gguf "
                        "--dtype bfloat16 --reference-dtype bfloat16"),
         Source(("faithfulness_gguf_2026-12-04_zen4_smollm2.json",), "0z9", "family 25 model 17",
                command="kvmesh eval faithfulness --model smollm2-135m-instruct --weight-format gguf --dtype bfloat16"),
         Source(("model_choice_2026-12-01_zen4.json",), "1c", "family 25 model 17",
                note="int8 / int4: kvmesh's own quantization of the bf16 conversion"),
         Source(("ablation_gate_2026-12-01_zen4_smollm2.json",), "1a", "family 25 model 17"),
         Source(("ablation_gate_2026-12-01_zen4_qwen05.json",), "1a", "family 25 model 17")),
        quality),
    Question(
        "Soak: 2,000 requests through `kvmesh serve`",
        "`bench.soak`: `kvmesh serve --model smollm2-135m-instruct`; chats, short prompts, stop strings, "
        "cancellations, deadlines, aborts and bad requests at concurrency 16 through the gRPC gateway; every "
        "answer checked against what its kind expects, the RSS of each process after warm-up and at the end "
        "(idle). The pp-2 run has the real process shapes (the gateway and scheduler in one process, the engine "
        "process, two Ray stage processes) with the KV tiers on, a Redis restart and a stage killed in the "
        "middle: a request open while its replica is down may only end UNAVAILABLE if it had received tokens "
        "(`replica N failed`, its stream cannot be resumed); its RSS growth is outside the bounded caches (the KV "
        "pool's resident pages, the host tier's bytes, Ray's object store pages) from each process's own idle "
        "baseline (the restarted ones: after their own warm-up).",
        ("figure", "value"),
        (Source(("soak_2026-12-04_zen4_pp2.json",), "0z13", "family 25 model 17"),
         Source(("soak.json",), "6", "family 26 model 2"),),
        soak),
)


# ---- the page -------------------------------------------------------------------------------------

def render(docs: Path = DOCS, history_text: str | None = None) -> str:
    """The block between the markers: every question's table from the JSON files in ``docs``
    (raises :class:`PageError` when a source does not hold)."""
    history_text = (docs / HISTORY.name).read_text() if history_text is None else history_text
    intro, sections = read_history(history_text)
    out = ["<!-- generated by `python -m bench.results_page` from the JSON files named in the tables; "
           "do not edit by hand -->"]
    for i, q in enumerate(QUESTIONS, 1):
        runs = [read_run(s, intro, sections, docs) for s in q.sources]
        rows = [[*cells, r.cpu, r.date, r.cell] for r in runs for cells in q.rows(r)]
        commands = []
        for r in runs:
            line = f"- `{r.command}`"
            if line not in commands:
                commands.append(line)
        out += [f"## {i}. {q.title}", q.intro, md_table((*q.header, "CPU", "date", "source"), rows),
                "Commands:\n\n" + "\n".join(commands)]
    return "\n\n".join(out)


def update(path: Path = PAGE, docs: Path = DOCS) -> bool:
    """Rewrite the generated block of ``path``; True when its text changed."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise PageError(f"{path} lacks the markers {BEGIN} ... {END}")
    new = text[:text.index(BEGIN)] + "\n".join([BEGIN, render(docs), END]) + text[text.index(END) + len(END):]
    if new != text:
        path.write_text(new)
    return new != text


def is_current(path: Path = PAGE, docs: Path = DOCS) -> bool:
    """Whether ``path``'s generated block is what :func:`render` gives now."""
    text = path.read_text()
    return "\n".join([BEGIN, render(docs), END]) in text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.results_page", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/results.md is not current; write nothing")
    args = p.parse_args(argv)
    try:
        if args.check:
            if is_current():
                return 0
            print(f"{PAGE} is not current: run python -m bench.results_page", file=sys.stderr)
            return 1
        print(f"{PAGE}: {'updated' if update() else 'already current'}")
        return 0
    except PageError as e:
        print(f"bench.results_page: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
