"""The sampling flags of the commands that generate (``generate``, ``chat``, ``demo``) and what
they become: engine :class:`~kvmesh.core.sampling.SamplingParams` in this process, or the
keywords of a gateway request."""

from __future__ import annotations

import argparse

from kvmesh.core.sampling import SamplingParams


def add_sampling_args(p: argparse.ArgumentParser, *, max_tokens: int, temperature: float | None = None) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help=f"most tokens to generate ({max_tokens})")
    g.add_argument("--temperature", type=float, default=temperature, metavar="T",
                   help=f"0 = greedy ({1.0 if temperature is None else temperature})")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass (1.0 = off)")
    g.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens (-1 = off)")
    g.add_argument("--min-p", type=float, metavar="P", help="drop tokens below P x the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="CTRL-style penalty (1.0 = off)")
    g.add_argument("--seed", type=int, help="per-request sampling seed")
    g.add_argument("--stop", nargs="+", default=[], metavar="S", help="stop strings (not included in the output)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams from the sampling flags; raises EngineError for a bad value."""
    kw = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
          if getattr(args, k) is not None}
    return SamplingParams(max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos, **kw)


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The sampling flags as ``kvmesh.v1.SamplingParams`` keywords: only those given (the
    server's defaults apply to the rest), validated here first (EngineError)."""
    sampling_params(args)
    kw = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                                        "max_tokens") if getattr(args, k) is not None}
    if args.stop:
        kw["stop"] = args.stop
    if args.ignore_eos:
        kw["ignore_eos"] = True
    return kw
