"""Network addresses: how a service's listen address is written and where a local client reaches it."""

from __future__ import annotations


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:50051``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def connect_address(host: str, port: int) -> str:
    """Where a local client reaches a service bound to ``host`` (a wildcard → loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    return host_port(host, port)
