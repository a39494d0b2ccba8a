"""``kvmesh models list`` and ``kvmesh models pull`` (the model hub, :mod:`kvmesh.hub`)."""

from __future__ import annotations

import argparse

from kvmesh.cli.demo import DEMO_MODEL


def register(sub) -> None:
    """Add ``models list`` and ``models pull`` to the top-level subparsers ``sub``."""
    models = sub.add_parser("models", help="list and pull known models")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = msub.add_parser("list", help="known models, pulled or not, and where")
    p.set_defaults(func=cmd_list)
    p = msub.add_parser("pull", help="download the pinned GGUF weights, served as they are (idempotent)")
    p.add_argument("names", nargs="+", metavar="NAME", help="known model name(s)")
    p.add_argument("--force", action="store_true", help="pull again even if already pulled")
    p.add_argument("--dense", action="store_true",
                   help="also convert to bfloat16 safetensors now (--weight-format none, transformers/vLLM "
                        "readers); otherwise converted on first use, once")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)


def cmd_list(args: argparse.Namespace) -> int:
    """``kvmesh models list``: every known model, pulled or not, and where."""
    from kvmesh.hub.cache import is_pulled, kvmesh_home, model_dir
    from kvmesh.hub.manifest import DEFAULT_MODEL, KNOWN_MODELS

    print(f"models live in {kvmesh_home() / 'models'} (KVMESH_HOME)")
    rows = [("NAME", "STATE", "UPSTREAM", "PATH")]
    for name, spec in sorted(KNOWN_MODELS.items()):
        pulled = is_pulled(name)
        label = name + (" (default)" if name == DEFAULT_MODEL else "") + (" (demo)" if name == DEMO_MODEL else "")
        rows.append((label, "pulled" if pulled else "not pulled", spec.hf_repo, str(model_dir(name)) if pulled else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[3])
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """``kvmesh models pull [--dense] NAME...`` (:func:`kvmesh.hub.pull.pull_cli`); a pulled model is a
    no-op (with ``--dense``, unless its dense weights are missing)."""
    from kvmesh.hub.pull import pull_cli
    return pull_cli(args.names, progress=not args.quiet, force=args.force, dense=args.dense)
