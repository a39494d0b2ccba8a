"""The bottom layer of kvmesh: what every other layer may use, depending on nothing of ours but
the generated protos (:mod:`kvmesh.v1`).

========================  =====================================================================
module                    concept
========================  =====================================================================
:mod:`.errors`            error types by who is at fault (:class:`~.errors.EngineError` and kin)
:mod:`.status`            the one mapping of errors to gRPC and HTTP statuses
:mod:`.sampling`          :class:`~.sampling.SamplingParams`
:mod:`.config`            typed settings of the engine, the scheduler service and the gateway
:mod:`.telemetry`         tracing (OpenTelemetry) setup and context propagation
:mod:`.metrics`           the services' Prometheus metrics and their ``/metrics`` endpoint
:mod:`.net`, :mod:`.tls`  addresses; TLS credentials from PEM files
:mod:`.grpc_server`       the gRPC server scaffold of both services (bind, health, reflection,
                          metrics, graceful stop)
:mod:`.proto`             conversions between the protos and the engine's types
:mod:`.memory`            giving freed memory back to the OS (``malloc_trim``) when idle
========================  =====================================================================

Layers (tests/test_import_layers.py checks them): bench > front (``kvmesh.cli``, ``kvmesh.llm``,
``kvmesh.serve``, ``kvmesh.client``) > gateway > scheduler > workers > kvstore > ``kvmesh.core``
> ``kvmesh.v1``.
"""
