"""A tenant's share (keys file weight= / max_cached_blocks=) on its way to the workers."""
from __future__ import annotations

from pathlib import Path

import pytest

from contracts.requests import TenantShare
from contracts.wire import to_generate_input, to_tenant_share
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.security.auth import parse_keys_file


def test_keys_file_weight_and_max_cached_blocks(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("ka alpha weight=2 admin\nkb beta max_cached_blocks=40 salt=s\nkc gamma\n")
    alpha, beta, gamma = parse_keys_file(path)
    assert (alpha.weight, alpha.max_cached_blocks, alpha.admin) == (2.0, None, True)
    assert (beta.weight, beta.max_cached_blocks, beta.salt) == (1.0, 40, "s")
    assert (gamma.weight, gamma.max_cached_blocks) == (1.0, None)


@pytest.mark.parametrize("option", ["weight=0", "weight=-1", "weight=x", "weight=nan", "max_cached_blocks=-3",
                                    "max_cached_blocks=1.5", "weight=1 weight=2"])
def test_keys_file_rejects_a_bad_share(tmp_path: Path, option: str) -> None:
    path = tmp_path / "keys"
    path.write_text(f"ka alpha {option}\n")
    with pytest.raises(ValueError, match=r"keys:1"):
        parse_keys_file(path)


def test_the_share_crosses_the_wire() -> None:
    share = TenantShare("beta", 0.5, 40, busy_tenants=3)
    msg = pb.GenerateRequest(request_id="r", text="hi", tenant=to_tenant_share(share))
    assert to_generate_input(pb.GenerateRequest.FromString(msg.SerializeToString())).tenant == share
    plain = to_generate_input(pb.GenerateRequest(request_id="r", text="hi"))
    assert plain.tenant == TenantShare("", 1.0, None)
