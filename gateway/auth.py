"""API keys and tenants of the public gateway: who a caller is, for gRPC and HTTP alike.

Keys come from ``--api-keys-file FILE`` (:attr:`kvmesh.core.service_config.GatewayConfig.api_keys_file`), one
``TENANT:KEY`` per line (blank lines and ``#`` comments ignored), and/or the environment variable
``KVMESH_API_KEYS`` (the same entries, separated by commas or newlines). A tenant may hold several
keys (rotation); a key names one tenant. With neither source the gateway is open and every
request is tenant ``""``; with a source, even one that lists no key, every request needs a key.

* Only SHA-256 digests of the keys are kept in memory (never the keys).
* A caller sends ``authorization: Bearer <key>`` (gRPC metadata, HTTP header). :meth:`ApiKeys.tenant_for`
  hashes the key it was given and compares the digest with **every** stored digest with
  :func:`hmac.compare_digest`, so the time taken depends neither on which key matched nor on how
  much of a wrong key matches a real one.
* Revocation: delete the key's line. The file is read again when its modification time, size,
  inode or change time (ctime: any write, and ``touch``/``os.utime`` putting an old mtime back)
  changes (one ``stat`` per check), when the SHA-256 of its bytes changes (read at most once a
  second: an edit a filesystem's coarse timestamps miss), or on :meth:`ApiKeys.reload`
  (``kvmesh serve`` and ``kvmesh gateway`` call it on SIGHUP). A file that no longer parses, or
  has gone, keeps the keys in use and logs an error.
* gRPC: :class:`ApiKeyInterceptor` refuses an RPC without a valid key with UNAUTHENTICATED and one
  generic message (nothing about which keys or tenants exist), before its request is read;
  health checking and server reflection stay open. An accepted RPC runs with its tenant in
  :data:`CURRENT_TENANT`.
* HTTP: ``ApiKeys.tenant_for(request.headers.get("authorization"))``; None → 401 with
  :data:`UNAUTHENTICATED_MESSAGE`.

The tenant labels the gateway's metrics (bounded: the tenants of the keys) and its trace spans,
and partitions the prefix cache: :func:`cache_salt` derives each request's salt from its tenant.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import inspect
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import grpc

from kvmesh.core.errors import EngineError, SettingsError

log = logging.getLogger("kvmesh.gateway")

ENV_KEYS = "KVMESH_API_KEYS"
HASH_INTERVAL = 1.0     # seconds between two reads of the keys file for its SHA-256
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send the header 'authorization: Bearer <key>'"
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# the tenant of the RPC being served (set by ApiKeyInterceptor; "" when keys are off)
CURRENT_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("kvmesh_tenant", default="")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_entries(text: str, source: str, *, separators: str = "\n") -> list[tuple[str, bytes]]:
    """``(tenant, sha256(key))`` of each ``TENANT:KEY`` entry of ``text`` (entries split at any
    character of ``separators``; blank entries and ``#`` comments skipped).

    Raises:
        EngineError: naming ``source`` and the entry's number (never the key) for an entry
            without ``:``, a tenant not matching ``[A-Za-z0-9][A-Za-z0-9._-]{0,63}``, an empty key
            or one holding whitespace, or a key listed twice.
    """
    entries: list[tuple[str, bytes]] = []
    seen: set[bytes] = set()
    for n, raw in enumerate(re.split(f"[{re.escape(separators)}]", text), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, key = line.partition(":")
        tenant, key = tenant.strip(), key.strip()
        where = f"{source}, entry {n}"
        if not sep:
            raise SettingsError(f"{where}: expected TENANT:KEY")
        if not TENANT_PATTERN.fullmatch(tenant):
            raise SettingsError(f"{where}: tenant {tenant!r} must match [A-Za-z0-9][A-Za-z0-9._-]{{0,63}}")
        if not key or any(c.isspace() for c in key):
            raise SettingsError(f"{where}: the key of tenant {tenant!r} is empty or holds whitespace")
        d = _digest(key)
        if d in seen:
            raise SettingsError(f"{where}: a key is listed twice (each key names one tenant)")
        seen.add(d)
        entries.append((tenant, d))
    return entries


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of an ``authorization`` value with the ``Bearer`` scheme (any case),
    None for anything else."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class ApiKeys:
    """The API keys of one gateway (module docstring). Thread-safe.

    Args:
        path: the keys file ("" = none).
        env_value: entries as in ``KVMESH_API_KEYS`` ("" = none).
    Raises:
        EngineError: the file cannot be read, or an entry is malformed (see :func:`parse_entries`).
    """

    _clock = staticmethod(time.monotonic)      # HASH_INTERVAL's clock

    def __init__(self, path: str = "", env_value: str = ""):
        self.path = path
        self._env = parse_entries(env_value, ENV_KEYS, separators=",\n") if env_value else []
        self._file: list[tuple[str, bytes]] = []
        self._stamp: tuple | None = None
        self._sha: bytes | None = None      # of the bytes last read
        self._hashed_at = self._clock()
        self._lock = threading.Lock()
        if path:
            self._stamp, self._sha, self._file = self._read()

    @classmethod
    def load(cls, path: str = "", env: Mapping[str, str] | None = None) -> "ApiKeys | None":
        """The keys of ``path`` and of ``KVMESH_API_KEYS`` in ``env`` (default ``os.environ``);
        None when neither is given (keys off). Raises EngineError as the constructor."""
        env_value = (os.environ if env is None else env).get(ENV_KEYS, "").strip()
        if not path and not env_value:
            return None
        return cls(path, env_value)

    @property
    def tenants(self) -> tuple[str, ...]:
        """Every tenant with a key now, sorted (metric label values)."""
        return tuple(sorted({t for t, _ in self._env + self._file}))

    @staticmethod
    def _stamp_of(st: os.stat_result) -> tuple:
        return st.st_mtime_ns, st.st_size, st.st_ino, st.st_ctime_ns

    def _read(self) -> tuple[tuple, bytes, list[tuple[str, bytes]]]:
        """(stat stamp, SHA-256 of the bytes, entries) of the file."""
        try:
            st = os.stat(self.path)
            with open(self.path, "rb") as f:
                data = f.read()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"api_keys_file: cannot read {self.path}: {e}") from None
        return self._stamp_of(st), hashlib.sha256(data).digest(), parse_entries(text, self.path)

    def reload(self) -> bool:
        """Read the file again (SIGHUP). Returns True when the keys are the file's current ones;
        False (keys unchanged, error logged) when it cannot be read or parsed."""
        if not self.path:
            return True
        with self._lock:
            try:
                self._stamp, self._sha, self._file = self._read()
                self._hashed_at = self._clock()
            except EngineError as e:
                log.error("API keys not reloaded, the previous keys stay in use: %s", e)
                return False
        log.info("API keys reloaded from %s: %d key(s), %d tenant(s)", self.path,
                 len(self._file) + len(self._env), len(self.tenants))
        return True

    def _check_file(self) -> None:
        """Reload when the file's (mtime, size, inode, ctime) changed since it was read, or, at
        most once every HASH_INTERVAL seconds, when the SHA-256 of its bytes did."""
        if not self.path:
            return
        try:
            stamp = self._stamp_of(os.stat(self.path))
        except OSError:
            stamp = None
        if stamp != self._stamp:
            if not self.reload():
                self._stamp = stamp          # log a broken file once, not on every request
            return
        now = self._clock()
        if stamp is None or now - self._hashed_at < HASH_INTERVAL:
            return
        with self._lock:
            self._hashed_at = now
            try:
                with open(self.path, "rb") as f:
                    sha = hashlib.sha256(f.read()).digest()
            except OSError:
                return
        if sha != self._sha and not self.reload():
            self._sha = sha                  # the same: logged once

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an ``authorization`` header/metadata value (``Bearer <key>``), None when
        it is missing, not a bearer token or not a current key. Every stored digest is compared
        (:func:`hmac.compare_digest`) whatever matches."""
        self._check_file()
        token = bearer_token(authorization)
        if token is None:
            return None
        digest = _digest(token)
        found = None
        for tenant, stored in self._env + self._file:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found


def cache_salt(tenant: str, client_salt: str = "") -> str:
    """``SubmitRequest.cache_salt`` of a request: "" when it has neither a tenant nor a salt of its
    own (the unpartitioned cache); else the SHA-256 hex digest of the tenant and the client's
    salt. Requests of two tenants never share a salt (nor cached KV blocks), whatever salts the
    clients send; a tenant may split its own cache further with ``cache_salt``. Neither the
    tenant's name nor the client's salt reaches the scheduler, only this digest (and from it only
    block hashes reach the prefix index)."""
    if not tenant and not client_salt:
        return ""
    return hashlib.sha256(b"kvmesh-cache-salt\0" + tenant.encode("utf-8") + b"\0"
                          + client_salt.encode("utf-8")).hexdigest()


# ---- gRPC ----------------------------------------------------------------------------------------

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _kind(handler: grpc.RpcMethodHandler) -> str:
    return _KINDS[2 * bool(handler.request_streaming) + bool(handler.response_streaming)]


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` that ends the RPC UNAUTHENTICATED without parsing its request."""
    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    return handler._replace(request_deserializer=None, **{_kind(handler): deny})


def _as_tenant(handler: grpc.RpcMethodHandler, tenant: str) -> grpc.RpcMethodHandler:
    """``handler`` whose behaviour runs with :data:`CURRENT_TENANT` = ``tenant``."""
    kind = _kind(handler)
    behavior = getattr(handler, kind)
    if inspect.isasyncgenfunction(behavior):
        async def run(request, context):
            CURRENT_TENANT.set(tenant)
            async for item in behavior(request, context):
                yield item
    elif inspect.iscoroutinefunction(behavior):
        async def run(request, context):
            CURRENT_TENANT.set(tenant)
            return await behavior(request, context)
    else:                       # a sync behaviour runs in an executor: hand it the context as is
        return handler
    return handler._replace(**{kind: run})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses RPCs without a valid API key (UNAUTHENTICATED, generic message) before their
    request is read, except to ``open_services`` (health, reflection); runs the others with
    their tenant in :data:`CURRENT_TENANT`. ``on_denied(method)`` is called for each refusal
    (``method``: ``Generate``, ``Chat`` ...; metrics)."""

    def __init__(self, keys: ApiKeys, open_services: Iterable[str] = (),
                 on_denied: Callable[[str], None] | None = None):
        self.keys, self.open_services = keys, frozenset(open_services)
        self.on_denied = on_denied

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service, _, method = details.method.lstrip("/").partition("/")
        if handler is None or service in self.open_services:
            return handler
        auth = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if isinstance(auth, bytes):
            auth = auth.decode("utf-8", "replace")
        tenant = self.keys.tenant_for(auth)
        if tenant is None:
            if self.on_denied is not None:
                self.on_denied(method)
            return _denied(handler)
        return _as_tenant(handler, tenant)
