"""The checked-in gRPC/protobuf stubs in proto/kvmesh/v1 are what `make proto` generates from
kvmesh.proto now (the pinned grpcio-tools): the oracle is protoc itself, run into a temp dir."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTO = Path("proto/kvmesh/v1/kvmesh.proto")
STUBS = ("kvmesh_pb2.py", "kvmesh_pb2.pyi", "kvmesh_pb2_grpc.py")


@pytest.mark.multiproc
def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    (tmp_path / PROTO.parent).mkdir(parents=True)
    shutil.copy(ROOT / PROTO, tmp_path / PROTO)   # same relative path: protoc embeds it in the stubs
    r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
                        "--grpc_python_out=.", str(PROTO)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    stale = [name for name in STUBS
             if (tmp_path / PROTO.parent / name).read_text() != (ROOT / PROTO.parent / name).read_text()]
    if stale:
        pytest.fail(f"{', '.join(stale)} differ from what protoc generates from {PROTO}: run `make proto`")
