"""Generated gRPC stubs of the kvmesh.v1 API (source: protos/kvmesh/v1/*.proto).

Do not edit the ``*_pb2*.py`` files: change the .proto files and run ``make protos``;
tests/test_protos.py fails when these stubs are stale.
"""
