"""TLS for kvmesh's gRPC services and clients: credentials from PEM files.

* The public gateway (``--tls-cert-file``, ``--tls-key-file``) and the scheduler service (the
  same flags on ``kvmesh scheduler``; ``--scheduler-tls-*`` under ``kvmesh serve``) listen with
  TLS when given a certificate chain and its private key; a plaintext client is refused (its
  handshake fails: UNAVAILABLE on the client).
* Mutual TLS between the gateway and the scheduler: the scheduler's ``--tls-client-ca-file``
  makes it require a client certificate signed by that CA; the gateway presents
  ``--scheduler-tls-client-cert-file`` / ``--scheduler-tls-client-key-file`` and checks the
  scheduler's certificate against ``--scheduler-tls-ca-file`` (``--scheduler-tls-server-name``
  when the certificate names a host other than the one dialled).
* Clients (``kvmesh generate/chat --server``, :class:`kvmesh.client.Client`) verify the gateway
  with ``--tls-ca-file`` (``tls=True``: the system's roots).

Files are read once, at start; every error names the setting and the file. Probes that cannot
speak TLS (Kubernetes' ``grpc:`` probes) ask a plaintext health-only port (``--health-port``,
:mod:`kvmesh.core.grpc_server`).
"""

from __future__ import annotations

import grpc

from kvmesh.core.errors import SettingsError


def read_pem(path: str, setting: str) -> bytes:
    """The bytes of a PEM file. Raises SettingsError naming ``setting`` when it cannot be read or
    holds no PEM block."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SettingsError(f"{setting}: cannot read {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise SettingsError(f"{setting}: {path} is not a PEM file (no -----BEGIN line)")
    return data


def server_credentials(cert_file: str, key_file: str, client_ca_file: str = "", *,
                       prefix: str = "") -> grpc.ServerCredentials:
    """Credentials of a TLS listener: the certificate chain and key; with ``client_ca_file``, every
    client must present a certificate signed by that CA (mutual TLS). ``prefix`` names the
    settings in errors (``scheduler_`` ...). Raises SettingsError."""
    pair = (read_pem(key_file, f"{prefix}tls_key_file"), read_pem(cert_file, f"{prefix}tls_cert_file"))
    if client_ca_file:
        return grpc.ssl_server_credentials([pair], root_certificates=read_pem(client_ca_file,
                                                                              f"{prefix}tls_client_ca_file"),
                                           require_client_auth=True)
    return grpc.ssl_server_credentials([pair])


def channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "", *,
                        prefix: str = "") -> grpc.ChannelCredentials:
    """Credentials of a TLS channel: the server is checked against ``ca_file`` ("" = the system's
    roots); ``cert_file``/``key_file`` (both or neither) are this client's certificate for mutual
    TLS. Raises SettingsError."""
    if bool(cert_file) != bool(key_file):
        raise SettingsError(f"{prefix}tls_client_cert_file and {prefix}tls_client_key_file go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca_file, f"{prefix}tls_ca_file") if ca_file else None,
        private_key=read_pem(key_file, f"{prefix}tls_client_key_file") if key_file else None,
        certificate_chain=read_pem(cert_file, f"{prefix}tls_client_cert_file") if cert_file else None)


def server_name_option(server_name: str) -> list[tuple[str, str]]:
    """Channel options that check the server's certificate for ``server_name`` instead of the
    dialled host (none when ""): e.g. the scheduler's Kubernetes service name while dialling an IP."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []
