"""Talking to a kvmesh gateway from the command line: the ``--server`` flags, connecting,
streaming a response to the terminal, its summary line, and how an RPC error becomes an exit
code (``kvmesh generate --server``, ``kvmesh chat``, ``kvmesh demo``)."""

from __future__ import annotations

import argparse
import os
import sys

from kvmesh.core.errors import EngineError


def stream_responses(out, responses):
    """Write the text deltas of a GenerateResponse stream to ``out`` as they arrive (then a
    newline unless the text ends with one); returns the whole text and the final response."""
    final, parts = None, []
    for r in responses:
        if r.text:
            out.write(r.text)
            out.flush()
            parts.append(r.text)
        if r.finished:
            final = r
    text = "".join(parts)
    if not text.endswith("\n"):
        out.write("\n")
    out.flush()
    if final is None:
        raise EngineError("the server ended the stream without a final message")
    return text, final


def response_summary(final) -> str:
    """:func:`summary` of a final GenerateResponse: its usage and the scheduler's timings."""
    from kvmesh.core.proto import finish_reason_name

    u, t = final.usage, final.timings
    n_out = u.completion_tokens
    ttft = f"{t.ttft:.3f}" if final.HasField("timings") else "-"
    decode = f"{(n_out - 1) / t.decode_time:.1f}" if n_out > 1 and t.decode_time > 0 else "-"
    return (f"prompt {u.prompt_tokens} tokens ({u.cached_prompt_tokens} from prefix cache), "
            f"output {n_out} tokens, TTFT {ttft} s, decode {decode} tokens/s, finish {finish_reason_name(final)}")


# StatusCodes that mean "this request is refused" (exit 2, like a bad argument: a wrong API key
# too); others exit 1.
_REFUSED = ("INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION", "UNAUTHENTICATED",
            "PERMISSION_DENIED")


def rpc_error(e, address: str) -> int:
    """Print a grpc.RpcError as ``kvmesh: error: ...``; return the exit code."""
    code = e.code()
    name = code.name if code is not None else "UNKNOWN"
    if name == "UNAVAILABLE":
        print(f"kvmesh: error: cannot reach the kvmesh server at {address}: {e.details()}", file=sys.stderr)
    else:
        print(f"kvmesh: error: {e.details()} ({name})", file=sys.stderr)
    return 2 if name in _REFUSED else 1


class ServerUnavailable(Exception):
    """The gateway did not become ready in time (``kvmesh: error: ...``, exit 1)."""


def connect(address: str, wait: float, api_key: str | None = None, tls_ca_file: str | None = None):
    """A :class:`kvmesh.client.Client` of the gateway at ``address`` (with ``api_key``; TLS checked
    against ``tls_ca_file`` when given), once it is ready; raises ServerUnavailable after ``wait``
    seconds."""
    from kvmesh.client import Client

    client = Client(address, api_key=api_key or None, tls_ca_file=tls_ca_file or None)
    try:
        client.wait_ready(timeout=wait)
    except BaseException as e:
        client.close()
        if isinstance(e, TimeoutError):
            raise ServerUnavailable(str(e)) from None
        raise
    return client


def add_server_arg(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--server", required=required, metavar="HOST:PORT",
                   help="a kvmesh gateway (`kvmesh serve` / `kvmesh gateway`)"
                        + ("" if required else "; default: run the engine in this process"))
    p.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="how long to wait for the server to be ready (10 s)")
    p.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY"), metavar="KEY",
                   help="API key sent as 'authorization: Bearer KEY' (env KVMESH_API_KEY)")
    p.add_argument("--tls-ca-file", default=os.environ.get("KVMESH_TLS_CA_FILE"), metavar="PEM",
                   help="connect with TLS, checking the server's certificate against this CA "
                        "(env KVMESH_TLS_CA_FILE)")
