"""The committed gRPC stubs (kvmesh/v1) are exactly what `make protos` generates from protos/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_current(tmp_path):
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos, "no .proto files under protos/"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)], check=True)
    generated = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*.py*")}
    committed = {p.relative_to(ROOT): p.read_bytes() for p in (ROOT / "kvmesh" / "v1").glob("*_pb2*.py*")}
    assert generated.keys() == committed.keys(), "stubs missing or left over: run `make protos`"
    stale = [str(k) for k in generated if generated[k] != committed[k]]
    assert not stale, f"stale stubs {stale}: run `make protos` and commit the result"


def test_stubs_import_and_name_the_services():
    from kvmesh.v1 import llm_pb2, scheduler_pb2
    assert "LLMService" in llm_pb2.DESCRIPTOR.services_by_name
    assert "SchedulerService" in scheduler_pb2.DESCRIPTOR.services_by_name
