"""Settings: one typed object per service, from flags and ``KVMESH_*`` environment variables.

Precedence: explicit argument > ``KVMESH_<FIELD>`` environment variable > default. A class may
name another variable for a field in ``ENV_OVERRIDES`` (:func:`env_var`): SchedulerConfig's
``redis_url`` reads ``KVMESH_REDIS_URL``.

This module holds what the settings classes share: :func:`setting` (a field with its flag's
help), the :class:`Settings` base (``from_env``, ``replace``), :func:`env_var`, and the checks
and conversions their ``__post_init__`` run (strings from the environment, byte sizes, ports,
TLS). The classes themselves: :mod:`kvmesh.core.engine_config` (EngineConfig, one engine
replica) and :mod:`kvmesh.core.service_config` (SchedulerConfig, GatewayConfig: the scheduler
and gateway services). The flags are built from them by :mod:`kvmesh.core.flags`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import fields
from typing import Self

from kvmesh.core.errors import SettingsError

def available_cpus() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_bytes(v: str | float | int) -> float:
    """A byte size as a float. Suffixes, any case: ``GiB``/``MiB``/``KiB`` and ``G``/``M`` binary
    (``"2GiB"``), ``GB``/``MB``/``KB`` decimal (``"512MB"``), ``B``; or a plain number (``1e9``;
    ``"0.2"``: settings read a value below 1 as a fraction). Raises ValueError when it does not
    parse."""
    if isinstance(v, (int, float)):
        return float(v)
    s = v.strip().lower().replace(" ", "")
    for suffix, mult in (("gib", 2**30), ("mib", 2**20), ("kib", 2**10), ("gb", 1e9), ("mb", 1e6), ("kb", 1e3), ("g", 2**30), ("m", 2**20), ("b", 1)):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * mult
    return float(s)


def setting(default, help: str, *, metavar: str | None = None, choices: tuple | None = None, kind: str = "",
            flag: str = "", short: str = ""):
    """A settings field whose default is stated here, once, with what its command-line flag
    needs (:mod:`kvmesh.core.flags` builds the flags from these): ``help`` (one line, without
    the default, which the flag's help adds), ``metavar``, ``choices``, ``kind`` (``"bytes"``:
    ``2GiB``-style sizes, ``"port"``, ``"optional_port"``: a port or -1/``off``) and ``flag``
    (another flag name than ``--<field>``; for a bool field, one that sets the opposite of
    the default) and ``short`` (a second, short spelling of the flag, e.g. ``-tp``)."""
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar, "choices": choices,
                                                        "kind": kind, "flag": flag, "short": short})


class Settings:
    """What the settings classes share: ``ENV_PREFIX`` (of their environment variables),
    :meth:`from_env` and :meth:`replace`."""

    ENV_PREFIX = "KVMESH_"

    @classmethod
    def from_env(cls, **overrides) -> Self:
        """Defaults, then the ``<ENV_PREFIX><FIELD>`` variables (:func:`env_var`), then
        ``overrides`` (None values ignored). Raises SettingsError naming a bad field."""
        kw = {}
        for f in fields(cls):
            env = os.environ.get(env_var(cls, f.name))
            if env is not None:
                kw[f.name] = env
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def replace(self, **kw) -> Self:
        """A copy with ``kw`` changed, checked again."""
        return dataclasses.replace(self, **kw)


def env_var(cls, field: str, prefix: str | None = None) -> str:
    """The environment variable of a settings field: ``<ENV_PREFIX><FIELD>``, unless the class
    names another one in ``ENV_OVERRIDES`` (e.g. ``KVMESH_REDIS_URL``)."""
    return getattr(cls, "ENV_OVERRIDES", {}).get(field) or f"{prefix or cls.ENV_PREFIX}{field.upper()}"


def coerce_strings(obj) -> None:
    """Environment variables arrive as strings: convert the int/float/bool fields of settings
    ``obj`` in place (the byte sizes through :func:`parse_bytes`). Raises SettingsError naming
    the field when a value does not parse."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, str) and f.type in ("int", "bool", "float"):
            try:
                if f.type == "bool":
                    v = v.strip().lower() in ("1", "true", "yes", "on")
                elif f.name in ("kv_cache_memory", "kv_offload_host_memory"):
                    v = parse_bytes(v)
                else:
                    v = int(v) if f.type == "int" else float(v)
            except ValueError:
                raise SettingsError(f"{f.name}: expected {f.type}, got {v!r}") from None
            setattr(obj, f.name, v)


def check_tls_files(obj) -> None:
    """Check a listener's TLS settings (``obj.tls_cert_file``, ``tls_key_file``, maybe
    ``tls_client_ca_file``): certificate and key together; a client CA only with them. Raises
    SettingsError naming the settings otherwise.
    Checked when the service starts (``check_tls``), not on construction: the settings of one
    service may come from several sources, each naming one file."""
    if bool(obj.tls_cert_file) != bool(obj.tls_key_file):
        raise SettingsError("tls_cert_file and tls_key_file go together (the certificate chain and its private key)")
    if getattr(obj, "tls_client_ca_file", "") and not obj.tls_cert_file:
        raise SettingsError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")


# The metrics ports deployments use (deploy/: compose, Kubernetes, prometheus.yml); the services'
# own default is off (metrics_port -1), so that several meshes on one host do not collide.
SCHEDULER_METRICS_PORT = 9461
GATEWAY_METRICS_PORT = 9451


def metrics_port_off(obj, name: str = "metrics_port") -> None:
    """``KVMESH_*_METRICS_PORT=`` (empty), ``off`` or ``none`` mean -1 (no metrics server); the
    same for another optional port field ``name``."""
    v = getattr(obj, name)
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "off", "none")):
        setattr(obj, name, -1)


def check_metrics_port(obj, name: str = "metrics_port") -> None:
    """Raise SettingsError unless the port field ``name`` of ``obj`` is in [-1, 65535] (0: any
    free port, -1: off)."""
    if not -1 <= getattr(obj, name) <= 65535:
        raise SettingsError(f"{name} must be a port in [0, 65535], 0 = any free port, -1 = off; "
                            f"got {getattr(obj, name)}")
