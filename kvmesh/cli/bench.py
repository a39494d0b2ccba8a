"""``kvmesh bench WHAT`` and ``kvmesh eval WHAT``: the benchmark modules' own subcommands.

Each benchmark module registers its subcommand itself (``add_parser(subparsers)``, which sets
``func``); the CLI imports a module only when its command is run, and the benchmarks never
import the CLI. Here are the names and one-line help for ``kvmesh bench --help``.
"""

from __future__ import annotations

import importlib

# group -> [(command, module, help)]
COMMANDS = {
    "bench": [
        ("engine", "bench.engine_offline", "offline engine benchmark: naive / static / continuous (± prefix "
                                           "caching), fp32 and bf16"),
        ("serve", "bench.serve.command", "online serving benchmark (as `vllm bench serve`): arrivals, TTFT/TPOT/"
                                         "ITL/E2EL, goodput, over gRPC or OpenAI HTTP"),
        ("ablation", "bench.ablation", "one PolicyDesk table over the serving techniques (naive loop ... prefix "
                                       "routing, quantization, speculation): tok/s, TTFT, ITL, memory, faithfulness"),
    ],
    "eval": [
        ("faithfulness", "bench.faithfulness", "PolicyDesk key-fact accuracy, agreement with the unoptimised "
                                               "reference, grounding, quality gate"),
    ],
}
GROUP_HELP = {"bench": "benchmarks (see docs/benchmarks.md)", "eval": "quality evaluations (see docs/benchmarks.md)"}


def register(sub, argv: list[str]) -> None:
    """Add ``bench`` and ``eval`` to the top-level subparsers ``sub``. The command that ``argv``
    names is registered by its module (imported here); the others are listed by name only."""
    for group, commands in COMMANDS.items():
        gsub = sub.add_parser(group, help=GROUP_HELP[group]).add_subparsers(
            dest=f"{group}_command", metavar="WHAT", required=True)
        for name, module, help_ in commands:
            if argv[:2] == [group, name]:
                importlib.import_module(module).add_parser(gsub, help=help_)
            else:
                gsub.add_parser(name, help=f"{help_}; `kvmesh {group} {name} --help`")
