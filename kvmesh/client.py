"""A small synchronous client of the public gRPC API (``kvmesh.v1.LLMService``, served by the gateway).

A convenience over the generated stub, not a second API: requests and responses are the
protobuf messages of ``protos/kvmesh/v1/llm.proto``, and errors are ``grpc.RpcError``.

    from kvmesh.client import Client, collect

    with Client("127.0.0.1:50051") as c:
        c.wait_ready(timeout=60)
        for r in c.generate("The capital of France is", temperature=0, max_tokens=16):
            print(r.text, end="", flush=True)          # the last response has r.finished set
        text, final = collect(c.chat([{"role": "user", "content": "Hi!"}], session_id="s1"))
        print(final.usage.cached_prompt_tokens, final.timings.ttft)

Sampling keywords are the fields of ``kvmesh.v1.SamplingParams`` (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
``seed``, ``max_tokens``, ``min_tokens``, ``stop``, ``stop_token_ids``, ``ignore_eos``,
``logprobs``, ``skip_special_tokens``); a keyword left out (or None) takes the server's default.
``generate``/``chat`` return the gRPC call itself: iterate it for the streamed responses,
``.cancel()`` it to abort the request.

A gateway with API keys wants ``Client(address, api_key="...")`` (sent as ``authorization:
Bearer <key>`` on every call but the health check); one with TLS wants
``tls_ca_file="ca.pem"`` (or ``tls=True`` for a certificate the system trusts).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator, Mapping

import grpc
from google.protobuf import duration_pb2

from kvmesh.core.proto import sampling_params_to_proto
from kvmesh.v1 import llm_pb2, llm_pb2_grpc

SERVICE = "kvmesh.v1.LLMService"

Message = Mapping[str, str] | tuple[str, str] | llm_pb2.ChatMessage


def chat_messages(messages: Iterable[Message]) -> list[llm_pb2.ChatMessage]:
    """``{"role": ..., "content": ...}`` dicts, ``(role, content)`` pairs or ChatMessages."""
    out = []
    for m in messages:
        if isinstance(m, llm_pb2.ChatMessage):
            out.append(m)
        elif isinstance(m, Mapping):
            out.append(llm_pb2.ChatMessage(role=m["role"], content=m["content"]))
        else:
            role, content = m
            out.append(llm_pb2.ChatMessage(role=role, content=content))
    return out


def _duration(seconds: float | None) -> duration_pb2.Duration | None:
    if seconds is None:
        return None
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def collect(responses: Iterable[llm_pb2.GenerateResponse]) -> tuple[str, llm_pb2.GenerateResponse]:
    """Drain a stream: the whole text and the final response (finish reason, usage, timings)."""
    parts, final = [], None
    for r in responses:
        parts.append(r.text)
        if r.finished:
            final = r
    if final is None:
        raise RuntimeError("the stream ended without a final response")
    return "".join(parts), final


class Client:
    """Synchronous client of one gateway. ``rpc_timeout`` bounds the unary calls (seconds).

    Args:
        api_key: sent as ``authorization: Bearer <key>`` metadata (None = none).
        tls_ca_file: connect with TLS, checking the gateway's certificate against this PEM CA.
        tls: connect with TLS, checking against the system's roots (implied by ``tls_ca_file``).
    Raises:
        kvmesh.EngineError: ``tls_ca_file`` cannot be read.
    """

    def __init__(self, address: str, *, rpc_timeout: float | None = 60.0,
                 options: list[tuple[str, object]] | None = None, api_key: str | None = None,
                 tls_ca_file: str | None = None, tls: bool = False):
        self.address = address
        self.rpc_timeout = rpc_timeout
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        if tls or tls_ca_file:
            from kvmesh.core.tls import channel_credentials
            creds = channel_credentials(tls_ca_file or "", prefix="client ")
            self.channel = grpc.secure_channel(address, creds, options=options or [])
        else:
            self.channel = grpc.insecure_channel(address, options=options or [])
        self.stub = llm_pb2_grpc.LLMServiceStub(self.channel)

    # ---- streaming ------------------------------------------------------------------------------

    def generate(self, prompt: str | None = None, *, token_ids: Iterable[int] | None = None, model: str = "",
                 request_id: str = "", session_id: str = "", timeout: float | None = None,
                 cache_salt: str = "", **sampling_kw) -> Iterator[llm_pb2.GenerateResponse]:
        """Complete ``prompt`` (text) or ``token_ids``; returns the streaming call.
        ``timeout`` is the server-side deadline in seconds (None = the server's default);
        ``cache_salt`` partitions the prefix cache within the caller's tenant."""
        if (prompt is None) == (token_ids is None):
            raise ValueError("give exactly one of prompt and token_ids")
        req = llm_pb2.GenerateRequest(model=model, sampling=sampling_params_to_proto(**sampling_kw),
                                      timeout=_duration(timeout),
                                      request_id=request_id, session_id=session_id, cache_salt=cache_salt)
        if prompt is not None:
            req.prompt = prompt
        else:
            req.prompt_token_ids.ids.extend(token_ids)
        return self.stub.Generate(req, metadata=self.metadata)

    def chat(self, messages: Iterable[Message], *, model: str = "", request_id: str = "", session_id: str = "",
             timeout: float | None = None, cache_salt: str = "", **sampling_kw) -> Iterator[llm_pb2.GenerateResponse]:
        """Answer a conversation (rendered with the model's chat template); returns the
        streaming call. Keep one ``session_id`` per conversation: the router sends its turns
        to the replica that holds its prefix in the KV cache."""
        req = llm_pb2.ChatRequest(model=model, messages=chat_messages(messages),
                                  sampling=sampling_params_to_proto(**sampling_kw),
                                  timeout=_duration(timeout), request_id=request_id, session_id=session_id,
                                  cache_salt=cache_salt)
        return self.stub.Chat(req, metadata=self.metadata)

    # ---- unary ----------------------------------------------------------------------------------

    def tokenize(self, prompt: str | None = None, *, messages: Iterable[Message] | None = None,
                 model: str = "") -> llm_pb2.TokenizeResponse:
        """Token ids of ``prompt``, or of ``messages`` rendered with the chat template."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        req = llm_pb2.TokenizeRequest(model=model)
        if prompt is not None:
            req.prompt = prompt
        else:
            req.chat.messages.extend(chat_messages(messages))
        return self.stub.Tokenize(req, timeout=self.rpc_timeout, metadata=self.metadata)

    def list_models(self) -> list[llm_pb2.ModelInfo]:
        return list(self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=self.rpc_timeout,
                                         metadata=self.metadata).models)

    def abort(self, request_id: str) -> bool:
        """Cancel a running request by id; False when the server knows no such request."""
        return self.stub.Abort(llm_pb2.AbortRequest(request_id=request_id), timeout=self.rpc_timeout,
                               metadata=self.metadata).found

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until the server's gRPC health check says SERVING (the LLMService's status,
        or the server's overall one when it reports no per-service status).
        Raises TimeoutError after ``timeout`` seconds."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self.channel)
        service, last = SERVICE, "no answer"
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=min(left, 5.0),
                                 wait_for_ready=True)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and service:
                    service = ""            # only the overall status is reported
                    continue
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:   # no health service: any answer will do
                    self.stub.ListModels(llm_pb2.ListModelsRequest(), timeout=max(left, 0.1), wait_for_ready=True,
                                         metadata=self.metadata)
                    return
                last = ("no connection" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                        else f"{e.code().name}: {e.details()}")
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(f"kvmesh server at {self.address} not ready after {timeout:g} s ({last})")

    # ---- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel; in-flight streams are cancelled (their requests aborted)."""
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def new_session_id() -> str:
    return uuid.uuid4().hex
