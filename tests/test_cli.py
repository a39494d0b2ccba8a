"""Tests for the ``kvmesh`` command line (kvmesh/cli/, flags from kvmesh/core/flags.py), in-process through ``main([...])``
and once through the installed console script. Real SmolLM2-135M weights; at most one model
load per test."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh import cli
from kvmesh.core import flags
from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import GatewayConfig, SchedulerConfig

MODEL = "smollm2-135m-instruct"


def test_models_list_shows_pulled_smollm2(smollm2_dir, capsys):
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith(MODEL))
    assert " pulled " in line and str(smollm2_dir) in line
    assert "qwen2.5-coder-0.5b-instruct" in out


def test_generate_streams_text_and_summary(smollm2_dir, capsys):
    rc = cli.main(["generate", "--model", MODEL, "--prompt", "The capital of France is",
                   "--max-tokens", "8", "--temperature", "0"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "Paris" in cap.out
    summary = cap.err.strip().splitlines()[-1]
    assert re.search(r"prompt \d+ tokens .* output 8 tokens, TTFT [\d.]+ s, decode [\d.]+ tokens/s, "
                     r"finish length$", summary), summary


def test_generate_chat_uses_template(smollm2_tokenizer, capsys):
    system, question = "Answer in one word.", "What is the capital of France?"
    rc = cli.main(["generate", "--model", MODEL, "--chat", "--system", system, "--prompt", question,
                   "--max-tokens", "8", "--temperature", "0", "--stop", "\n"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "Paris" in cap.out
    templated = smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        tokenize=False, add_generation_prompt=True)
    n_expected = len(smollm2_tokenizer.encode(templated, add_special_tokens=False))
    assert f"prompt {n_expected} tokens" in cap.err


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--max-tokens", "0"], "max_tokens must be >= 1"),
    (["--system", "hi"], "--system needs --chat"),
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory"),
    (["--policy", "fastest"], "argument --policy: invalid choice"),
    (["--dtype", "int3"], "unknown dtype 'int3'"),
])
def test_generate_bad_arguments_exit_2(argv, message, capsys):
    rc = cli.main(["generate", "--prompt", "hi", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert "error: " in err and message in err
    assert "Traceback" not in err


def option_dests(command: str) -> set[str]:
    """The ``dest`` of every option of ``kvmesh <command>``."""
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return {a.dest for a in sub.choices[command]._actions if a.option_strings}


def test_every_engine_setting_has_a_flag(monkeypatch):
    assert option_dests("generate") >= {f.name for f in dataclasses.fields(EngineConfig)}
    monkeypatch.setenv("KVMESH_BLOCK_SIZE", "32")       # env applies where no flag is given
    monkeypatch.setenv("KVMESH_MAX_NUM_SEQS", "3")      # a flag beats the env
    args = cli.build_parser().parse_args([
        "generate", "--prompt", "x", "--model", "m", "--dtype", "bfloat16", "--kv-cache-dtype", "float32",
        "--kv-cache-memory", "512MiB", "--max-model-len", "256", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--policy", "static", "--no-prefix-caching",
        "--no-chunked-prefill", "--device", "cpu", "--num-threads", "1"])
    cfg = EngineConfig.from_env(**flags.engine_kwargs(args))
    assert cfg == EngineConfig(model="m", dtype="bfloat16", kv_cache_dtype="float32", block_size=32,
                               kv_cache_memory=512 * 2**20, max_model_len=256, max_num_seqs=4,
                               max_num_batched_tokens=128, policy="static", enable_prefix_caching=False,
                               enable_chunked_prefill=False, device="cpu", num_threads=1)
    defaults = EngineConfig.from_env(**flags.engine_kwargs(cli.build_parser().parse_args(
        ["generate", "--prompt", "x"])))
    assert defaults.enable_prefix_caching and defaults.block_size == 32 and defaults.max_num_seqs == 3


@pytest.mark.parametrize("cls, command", [(EngineConfig, "generate"), (SchedulerConfig, "scheduler"),
                                          (GatewayConfig, "gateway")])
def test_flags_are_generated_from_the_settings_fields(cls, command):
    """Each field's flag carries the field's help and shows the dataclass default (stated once, in
    the field); the flag's own default is None, so KVMESH_* variables apply when it is not given."""
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    prefix = {EngineConfig: "", SchedulerConfig: "scheduler_", GatewayConfig: "gateway_"}[cls]
    actions = {a.dest: a for a in sub.choices[command]._actions if a.option_strings}
    for f in dataclasses.fields(cls):
        a = actions[prefix + f.name]
        assert a.default is None and a.help.startswith(f.metadata["help"]), f.name
        shown = flags._shown_default(f)
        assert (f"(default: {shown})" in a.help) == bool(shown), (f.name, a.help)
    if cls is EngineConfig:
        assert "(default: 2GiB)" in actions["kv_cache_memory"].help
    else:
        assert "(default: off)" in actions[prefix + "metrics_port"].help


def test_bool_flags_and_their_negations():
    parse = lambda *a: flags.engine_kwargs(cli.build_parser().parse_args(["generate", "--prompt", "x", *a]))
    kw = parse("--no-prefix-caching", "--compile", "--fixed-speculative-tokens", "--no-calibration")
    assert (kw["enable_prefix_caching"], kw["enable_compile"], kw["speculative_adaptive"],
            kw["enable_calibration"]) == (False, True, False, False)
    kw = parse("--prefix-caching", "--no-compile")
    assert (kw["enable_prefix_caching"], kw["enable_compile"], kw["speculative_adaptive"]) == (True, False, None)
    args = cli.build_parser().parse_args(["scheduler", "--no-engine-process", "--no-restart-replicas",
                                          "--metrics-port", "off"])
    assert flags.scheduler_kwargs(args) == {**{f.name: None for f in dataclasses.fields(SchedulerConfig)},
                                                 "engine_process": False, "restart_replicas": False,
                                                 "metrics_port": -1}


def test_settings_argv_round_trips_through_kvmesh_serve():
    """``kvmesh bench serve`` hands its engine and scheduler flags to the ``kvmesh serve`` it starts
    (:func:`kvmesh.core.flags.settings_argv`): parsed again they are the same settings."""
    given = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-prefix-caching", "--compile",
             "--fixed-speculative-tokens", "--replicas", "2", "--no-engine-process", "--routing", "load"]
    bench_args = cli.build_parser(["bench", "serve"]).parse_args(["bench", "serve", *given])
    argv = (flags.settings_argv(bench_args, EngineConfig)
            + flags.settings_argv(bench_args, SchedulerConfig, "scheduler_", rename=flags.scheduler_rename(None)))
    serve_args = cli.build_parser().parse_args(["serve", *argv])
    assert flags.engine_kwargs(serve_args) == flags.engine_kwargs(bench_args)
    assert flags.scheduler_kwargs(serve_args) == flags.scheduler_kwargs(bench_args)
    assert flags.engine_kwargs(serve_args)["kv_cache_memory"] == 64 * 2**20


def test_cli_import_is_light_and_bench_commands_are_the_modules_own(capsys):
    """Importing the CLI loads no torch and no benchmark module; ``kvmesh bench serve`` gets its
    flags from bench.serve (imported for that command only), which does not import the CLI:
    with ``kvmesh.cli`` made unimportable, the benchmark modules still import."""
    code = "import sys, kvmesh.cli; print('torch' in sys.modules, any(m.split('.')[0] == 'bench' for m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"]
    code = ("import sys; sys.modules['kvmesh.cli'] = None\n"     # importing the CLI from bench would fail
            "import bench.serve.command, bench.ablation, bench.faithfulness, bench.engine_offline; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    assert cli.main(["bench", "serve", "--help"]) == 0
    assert "--request-rate" in capsys.readouterr().out
    assert cli.main(["bench", "--help"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in ("engine", "serve", "ablation"))


@pytest.mark.mesh
def test_demo_two_turns_hit_prefix_cache(smollm2_dir, capsys):
    rc = cli.main(["demo", "--model", MODEL, "--max-tokens", "8"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    out = cap.out
    assert "[turn 1] user: If I drive my own car" in out and "[turn 2] assistant: " in out
    assert len(re.findall(r"TTFT [\d.]+ s, decode [\d.-]+ tokens/s", out)) == 2
    first = int(re.search(r"prompt (\d+) tokens \(0 from prefix cache\)", out).group(1))
    assert first > 1000            # system prompt + a whole policy
    hit = re.search(r"prefix cache: turn 2 reused (\d+) of its (\d+) prompt tokens", out)
    reused, total = int(hit.group(1)), int(hit.group(2))
    assert first - 16 <= reused < total     # every full block of turn 1's prompt is reused


def test_console_script_reports_errors_without_traceback():
    exe = Path(sys.executable).with_name("kvmesh")
    assert exe.is_file(), "the kvmesh console script is not installed in this environment"
    p = subprocess.run([str(exe), "generate", "--model", "no-such-model", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.startswith("kvmesh: error: unknown model") and "Traceback" not in p.stderr
    p = subprocess.run([str(exe), "models", "list"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and MODEL in p.stdout
