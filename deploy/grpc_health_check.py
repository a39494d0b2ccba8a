"""Container health check over standard gRPC health checking (``grpc.health.v1.Health/Check``).

    python grpc_health_check.py HOST:PORT [SERVICE] [--timeout SECONDS]

Exit status 0 when the server answers SERVING for SERVICE (default ``""``: the server as a whole),
1 otherwise (NOT_SERVING, unknown service, unreachable, timeout); one line on stdout says which.
deploy/compose.yaml's healthchecks run it inside the kvmesh image (copied to
/opt/kvmesh/grpc_health_check.py); Kubernetes uses its native ``grpc:`` probe instead. It needs
only grpcio and grpcio-health-checking, dependencies of kvmesh, so the image downloads no probe
binary.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(serving, status name or error) of ``service`` at ``address``."""
    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="gRPC health check (grpc.health.v1): exit 0 when SERVING")
    p.add_argument("address", metavar="HOST:PORT")
    p.add_argument("service", nargs="?", default="", help="service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="RPC deadline in seconds (3)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    ok, status = check(args.address, args.service, args.timeout)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
