"""Disaggregated serving, the router's pure parts (router/routing/disagg.py) and the contracts
it speaks: when the hop is on, which workers decode, when a request skips the hop, the worker
role in the registry record, and the hand-off fields on the wire. The hop through real
processes is tests/integration/test_disagg.py."""
from __future__ import annotations

import pytest

from contracts.requests import BadRequest, PeerHint
from contracts.roles import WorkerRole
from contracts.wire import to_generate_input, to_peer_hint
from kvstore.metadata.registry import MetadataError, WorkerRecord
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig
from router.routing.disagg import SkipReason, is_active, skip_reason
from router.routing.types import WorkerId, WorkerInfo, decode_pool

P = WorkerInfo(WorkerId("p"), "h:1", WorkerRole.PREFILL)
D = WorkerInfo(WorkerId("d"), "h:2", WorkerRole.DECODE)
M = WorkerInfo(WorkerId("m"), "h:3")


def test_the_hop_is_on_only_with_both_a_prefill_and_a_decode_worker() -> None:
    assert is_active([P, D]) and is_active([P, D, M])
    assert not is_active([M]) and not is_active([P, M]) and not is_active([D, M]) and not is_active([])


def test_prefill_workers_decode_only_as_a_last_resort() -> None:
    assert decode_pool([P, D, M]) == [D, M]
    assert decode_pool([P, M]) == [M]
    assert decode_pool([P]) == [P]          # nothing else is live
    assert decode_pool([M]) == [M]


def test_short_prompts_cached_prompts_and_prompt_logprobs_skip_the_hop() -> None:
    assert skip_reason(1000, 0, 256, False) is None
    assert skip_reason(255, 0, 256, False) is SkipReason.SHORT
    assert skip_reason(1000, 800, 256, False) is SkipReason.CACHED     # 200 uncached on the decode worker
    assert skip_reason(1000, 744, 256, False) is None                  # exactly 256 uncached
    assert skip_reason(1000, 0, 256, True) is SkipReason.PROMPT_LOGPROBS
    assert skip_reason(1, 0, 0, False) is None                         # 0: every prompt takes the hop


def test_the_role_travels_in_the_registry_record() -> None:
    record = WorkerRecord(WorkerId("w"), "h:1", "m", 16, 64, "ab", 1, role="prefill")
    assert WorkerRecord.from_fields(record.to_fields()).role == "prefill"
    legacy = {k: v for k, v in record.to_fields().items() if k != "role"}
    assert WorkerRecord.from_fields(legacy).role == "mixed"             # a record written without one
    with pytest.raises(MetadataError, match="role"):
        WorkerRecord.from_fields(record.to_fields() | {"role": "router"})
    assert WorkerRole.parse("") is WorkerRole.MIXED
    with pytest.raises(ValueError, match="accepted: mixed, prefill, decode"):
        WorkerRole.parse("both")


def test_handoff_hints_and_prefill_only_requests_cross_the_wire() -> None:
    hint = PeerHint("p", "h:1", 9, handoff=True, timeout_s=2.5)
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), prefill_only=True)
    msg.peer_hints.append(to_peer_hint(hint))
    spec = to_generate_input(pb.GenerateRequest.FromString(msg.SerializeToString()))
    assert spec.prefill_only and spec.peer_hints == (hint,)
    msg.peer_hints[0].timeout_s = 0.0
    with pytest.raises(BadRequest, match="timeout_s"):               # a hand-off is always bounded
        to_generate_input(msg)
    plain = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]))
    plain.peer_hints.append(pb.PeerHint(worker_id="p", address="h:1", num_blocks=1, timeout_s=3.0))
    assert to_generate_input(plain).peer_hints == (PeerHint("p", "h:1", 1),)   # no hand-off: no timeout


def test_the_router_flags_are_checked() -> None:
    assert RouterConfig().disagg_min_prompt_tokens >= 0 and RouterConfig().disagg_transfer_timeout_s > 0
    with pytest.raises(ValueError, match="disagg_min_prompt_tokens"):
        RouterConfig(disagg_min_prompt_tokens=-1)
    with pytest.raises(ValueError, match="disagg_transfer_timeout_s"):
        RouterConfig(disagg_transfer_timeout_s=0.0)
