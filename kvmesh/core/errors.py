"""kvmesh's error types, split by who is at fault.

Every error kvmesh raises on purpose is an :class:`EngineError` (the public name:
``from kvmesh import EngineError``); its subclass says whose fault it is, and so which status a
service answers (:mod:`kvmesh.core.status`, the one mapping to gRPC and HTTP codes):

============================  ===============================  =====================================
class                         fault                            gRPC status (HTTP)
============================  ===============================  =====================================
:class:`InvalidRequestError`  the caller's request             INVALID_ARGUMENT (400)
:class:`DuplicateRequestError` the caller's request id          ALREADY_EXISTS (409)
:class:`CapacityError`        none: the server is full now     RESOURCE_EXHAUSTED (429)
:class:`DependencyUnavailableError` something kvmesh needs is   UNAVAILABLE (503)
                              down (scheduler, engine process,
                              a pipeline stage, Redis where
                              fatal, a download, a port)
:class:`SettingsError`        the operator's settings          INTERNAL (500): raised at start,
                                                               before any request
:class:`EngineError` itself   a bug, or not classified         INTERNAL (500)
============================  ===============================  =====================================

``EngineError`` stays a :class:`ValueError` (as it always was), so callers that catch
``ValueError`` around the engine keep working. The messages name the field or setting at fault.
"""

from __future__ import annotations


class EngineError(ValueError):
    """kvmesh refused or failed an operation; the message says why. The base class itself
    means nobody in particular is at fault (a bug): INTERNAL."""

    grpc_code = "INTERNAL"      # the name of the grpc.StatusCode a service answers


class InvalidRequestError(EngineError):
    """The request is bad: a sampling value out of range, an empty or too long prompt, a token
    id outside the vocabulary, a field over a limit. The message names the field."""

    grpc_code = "INVALID_ARGUMENT"


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight."""

    grpc_code = "ALREADY_EXISTS"


class CapacityError(EngineError):
    """The request is fine but the server cannot take it now or ever at this size: a full
    waiting queue, a KV pool that cannot hold the sequence. Retry later, elsewhere, or smaller."""

    grpc_code = "RESOURCE_EXHAUSTED"


class DependencyUnavailableError(EngineError):
    """Something kvmesh needs is down or unreachable: the scheduler, a replica's engine process
    or pipeline stage, a Redis that must answer, a model download, a port to listen on."""

    grpc_code = "UNAVAILABLE"


class SettingsError(EngineError):
    """A setting (flag, ``KVMESH_*`` variable, engine keyword, file it names) is wrong or does
    not go with another: the operator's fault, found when the service or engine starts."""

    grpc_code = "INTERNAL"


_BY_NAME = {c.__name__: c for c in (EngineError, InvalidRequestError, DuplicateRequestError, CapacityError,
                                    DependencyUnavailableError, SettingsError)}


def error_name(e: BaseException) -> str:
    """The name of ``e``'s kvmesh error class (its nearest one; ``EngineError`` for anything
    else), to send across a process boundary with the message (:func:`rebuild`)."""
    for cls in type(e).__mro__:
        if cls.__name__ in _BY_NAME and _BY_NAME[cls.__name__] is cls:
            return cls.__name__
    return EngineError.__name__


def rebuild(name: str, message: str) -> EngineError:
    """The error of class ``name`` (:func:`error_name`) with ``message``; an unknown name gives
    a plain :class:`EngineError`."""
    return _BY_NAME.get(name, EngineError)(message)
