"""Settings: one typed object per service, from flags and ``KVMESH_*`` environment variables.

Precedence: explicit argument > ``KVMESH_<FIELD>`` environment variable > default. A class may
name another variable for a field in ``ENV_OVERRIDES`` (:func:`env_var`): SchedulerConfig's
``redis_url`` reads ``KVMESH_REDIS_URL``.

This module is where callers import the settings from; they are defined in
:mod:`kvmesh.core.settings` (the base class, :func:`setting`, the shared checks),
:mod:`kvmesh.core.engine_config` (EngineConfig) and :mod:`kvmesh.core.service_config`
(SchedulerConfig, GatewayConfig). The flags are built from them by :mod:`kvmesh.core.flags`.
"""

from __future__ import annotations

from kvmesh.core.engine_config import (
    ATTENTION_BACKENDS,
    DTYPES,
    POLICIES,
    SPECULATIVE_METHODS,
    WEIGHT_FORMATS,
    EngineConfig,
)
from kvmesh.core.service_config import (
    EXECUTORS,
    ROUTING_POLICIES,
    STAGE_PLACEMENTS,
    GatewayConfig,
    SchedulerConfig,
)
from kvmesh.core.settings import (
    GATEWAY_METRICS_PORT,
    SCHEDULER_METRICS_PORT,
    Settings,
    _parse_bytes,
    available_cpus,
    env_var,
    setting,
)

__all__ = [
    "ATTENTION_BACKENDS", "DTYPES", "EXECUTORS", "GATEWAY_METRICS_PORT", "POLICIES", "ROUTING_POLICIES",
    "SCHEDULER_METRICS_PORT", "SPECULATIVE_METHODS", "STAGE_PLACEMENTS", "WEIGHT_FORMATS", "EngineConfig",
    "GatewayConfig", "SchedulerConfig", "Settings", "_parse_bytes", "available_cpus", "env_var",
    "setting",
]
