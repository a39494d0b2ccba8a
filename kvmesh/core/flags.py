"""Command-line flags generated from the settings' fields (:mod:`kvmesh.core.settings`).

Each field of a settings class becomes one flag: ``--<field>`` with dashes (a bool field
``enable_x`` or ``x`` becomes ``--x`` / ``--no-x``, unless its :func:`~kvmesh.core.settings.setting`
names another ``flag``), typed from the field's annotation (or its ``kind``), with the field's
``help``, ``metavar`` and ``choices`` and the field's default added to the help. The flags'
own defaults are None, so a flag that is not given leaves the field to its ``KVMESH_*``
variable and then its default (:meth:`~kvmesh.core.settings.Settings.from_env`): defaults are
stated once, in the dataclass.

The CLI (:mod:`kvmesh.cli`) and the benchmarks that start a mesh (``kvmesh bench serve``,
``kvmesh eval faithfulness``) add the flags of :class:`EngineConfig`,
:class:`SchedulerConfig` and :class:`GatewayConfig` with the functions below.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, Field, fields

from kvmesh.core.engine_config import EngineConfig
from kvmesh.core.service_config import GatewayConfig, SchedulerConfig
from kvmesh.core.settings import parse_bytes

Rename = Callable[[str, str], "str | None"]   # (field, flag) -> flag to use, or None = no flag


# ---- argument types -----------------------------------------------------------------------------

def _bytes(v: str) -> float:
    try:
        n = parse_bytes(v)
    except ValueError:
        n = -1.0
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected bytes (2GiB, 512MB, 1e9) or a fraction (0.5), got {v!r}")
    return n


def _port(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535] (0 = any free port), got {v!r}")
    return n


def _optional_port(v: str) -> int:
    if v.strip().lower() in ("off", "none"):
        return -1
    try:
        n = int(v)
    except ValueError:
        n = -2
    if not -1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535] (0 = any free port, -1 or off "
                                         f"= off), got {v!r}")
    return n


_KINDS = {"bytes": _bytes, "port": _port, "optional_port": _optional_port}
_TYPES = {"int": int, "float": float}
_METAVARS = {"int": "N", "float": "X", "str": "VALUE"}


# ---- one field, one flag ------------------------------------------------------------------------

def flag_name(f: Field) -> str:
    """The flag of field ``f``: its ``flag`` metadata, else ``--<name>`` (a bool's ``enable_``
    dropped), dashes for underscores."""
    return f.metadata.get("flag") or "--" + f.name.removeprefix("enable_").replace("_", "-")


def _shown_default(f: Field) -> str:
    """The field's default as the help shows it ("" = not shown)."""
    d, kind = f.default, f.metadata.get("kind")
    if d is MISSING or d == "" or f.metadata.get("flag"):
        return ""
    if f.type == "bool":
        return "on" if d else "off"
    if kind == "optional_port" and d == -1:
        return "off"
    if kind == "bytes":
        if d == 0:
            return "off"
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if d >= size and d % size == 0:
                return f"{d / size:g}{unit}"
    return f"{d:g}" if isinstance(d, float) else str(d)


def _argument(f: Field) -> dict:
    """``add_argument`` keywords of field ``f`` (without ``dest`` and ``default``)."""
    meta = f.metadata
    shown = _shown_default(f)
    kw: dict = {"help": meta.get("help", "") + (f" (default: {shown})" if shown else "")}
    if f.type == "bool":
        if meta.get("flag"):                # a flag that sets the opposite of the default
            kw.update(action="store_const", const=not f.default)
        else:
            kw.update(action=argparse.BooleanOptionalAction)
        return kw
    kw["type"] = _KINDS.get(meta.get("kind")) or _TYPES.get(f.type, str)
    if meta.get("choices"):
        kw["choices"] = tuple(c for c in meta["choices"] if c != "")
    else:
        kw["metavar"] = meta.get("metavar") or ("PORT" if "port" in (meta.get("kind") or "")
                                                else _METAVARS.get(f.type, "VALUE"))
    return kw


def add_settings_args(p, cls, *, dest_prefix: str = "", rename: Rename | None = None,
                      help_prefix: Callable[[str], str] | None = None, defaults: dict | None = None) -> None:
    """One flag per field of settings class ``cls`` on ``p`` (a parser or argument group):
    ``dest`` ``<dest_prefix><field>``, default None (or ``defaults[field]``). ``rename(field,
    flag)`` may change a flag or drop it (None; a renamed flag loses its ``short`` alias);
    ``help_prefix(field)`` is put before a help."""
    defaults = defaults or {}
    for f in fields(cls):
        flag = flag_name(f)
        if rename is not None and (flag := rename(f.name, flag)) is None:
            continue
        kw = _argument(f)
        if help_prefix is not None:
            kw["help"] = help_prefix(f.name) + kw["help"]
        short = [f.metadata["short"]] if f.metadata.get("short") and flag == flag_name(f) else []
        p.add_argument(flag, *short, dest=dest_prefix + f.name, default=defaults.get(f.name), **kw)


def settings_kwargs(args: argparse.Namespace, cls, dest_prefix: str = "") -> dict:
    """The fields of ``cls`` in parsed ``args`` as keywords (None = not given, or no such flag)."""
    return {f.name: getattr(args, dest_prefix + f.name, None) for f in fields(cls)}


def settings_argv(args: argparse.Namespace, cls, dest_prefix: str = "", rename: Rename | None = None,
                  skip: tuple[str, ...] = ()) -> list[str]:
    """The flags of ``cls`` given in ``args`` (not None, not in ``skip``) as arguments for another
    kvmesh command (e.g. the ``kvmesh serve`` a benchmark starts): ``[flag, value, ...]``."""
    argv = []
    for f in fields(cls):
        v = getattr(args, dest_prefix + f.name, None)
        flag = flag_name(f) if rename is None else rename(f.name, flag_name(f))
        if v is None or flag is None or f.name in skip:
            continue
        if f.type != "bool":
            argv += [flag, str(v)]
        elif f.metadata.get("flag"):
            argv += [flag] if v != f.default else []
        else:
            argv.append(flag if v else "--no-" + flag.removeprefix("--"))
    return argv


def given_flags(args: argparse.Namespace, cls, dest_prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """The flags of ``cls`` given in ``args`` (for a message that they do not apply)."""
    return [flag_name(f) for f in fields(cls)
            if f.name not in skip and getattr(args, dest_prefix + f.name, None) is not None]


# ---- the three services' settings --------------------------------------------------------------

# the scheduler's listener settings: under `kvmesh serve` (one process, two listeners) they are
# --scheduler-<flag>; they are absent where the mesh picks free ports (demo, bench serve)
_LISTENER = ("host", "port", "metrics_port", "health_port", "tls_cert_file", "tls_key_file", "tls_client_ca_file")


def add_engine_args(p: argparse.ArgumentParser, *, default_model: str | None = None) -> None:
    """One flag per EngineConfig field (dest ``<field>``); unset flags stay None, so ``KVMESH_*``
    variables and the defaults apply (``default_model`` is the exception: it beats KVMESH_MODEL)."""
    g = p.add_argument_group("engine settings", "Each flag also reads KVMESH_<FIELD> (e.g. KVMESH_DTYPE, "
                                                "KVMESH_ENABLE_PREFIX_CACHING=0); a flag wins.")
    add_settings_args(g, EngineConfig, defaults={"model": default_model})


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings of parsed ``args`` as EngineConfig keywords (None = not given)."""
    return settings_kwargs(args, EngineConfig)


def scheduler_rename(listen: str | None) -> Rename:
    """How the scheduler's flags are named: ``listen`` prefixes its listener flags (``"--"`` for
    ``kvmesh scheduler``, ``"--scheduler-"`` under ``kvmesh serve``, None: no listener flags)."""
    def rename(field: str, flag: str) -> str | None:
        if field not in _LISTENER:
            return flag
        return None if listen is None else listen + flag.removeprefix("--")
    return rename


def add_scheduler_args(p: argparse.ArgumentParser, *, listen: str | None = "--") -> None:
    """One flag per SchedulerConfig field (dest ``scheduler_<field>``; :func:`scheduler_rename`
    for ``listen``); unset flags stay None so ``KVMESH_SCHEDULER_*`` variables apply."""
    g = p.add_argument_group("scheduler settings", "Each flag also reads KVMESH_SCHEDULER_<FIELD> "
                                                   "(e.g. KVMESH_SCHEDULER_PP; --redis-url reads KVMESH_REDIS_URL); "
                                                   "a flag wins.")
    prefixed = listen not in (None, "--")
    add_settings_args(g, SchedulerConfig, dest_prefix="scheduler_", rename=scheduler_rename(listen),
                      help_prefix=lambda field: "the scheduler's " if prefixed and field in _LISTENER else "")


def scheduler_kwargs(args: argparse.Namespace) -> dict:
    """The scheduler settings of parsed ``args`` as SchedulerConfig keywords (None = not given)."""
    return settings_kwargs(args, SchedulerConfig, "scheduler_")


def add_gateway_args(p: argparse.ArgumentParser, *, in_mesh: bool = False) -> None:
    """One flag per GatewayConfig field (dest ``gateway_<field>``); unset flags stay None so
    ``KVMESH_GATEWAY_*`` variables apply. ``in_mesh``: no ``--scheduler-address`` (the mesh's own)."""
    g = p.add_argument_group("gateway settings", "Each flag also reads KVMESH_GATEWAY_<FIELD> "
                                                 "(e.g. KVMESH_GATEWAY_PORT); a flag wins.")
    add_settings_args(g, GatewayConfig, dest_prefix="gateway_",
                      rename=lambda field, flag: None if in_mesh and field == "scheduler_address" else flag)


def gateway_kwargs(args: argparse.Namespace) -> dict:
    """The gateway settings of parsed ``args`` as GatewayConfig keywords (None = not given)."""
    return settings_kwargs(args, GatewayConfig, "gateway_")
