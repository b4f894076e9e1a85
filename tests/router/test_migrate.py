"""Request migration's pieces without processes (router/routing/migrate.py): what is re-submitted, the
limit, and a stream cut when its worker is found lost. End to end: tests/integration/test_chaos.py."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from kvmesh.bench.chaos import ChaosConfig
from kvmesh.serve.supervise import Cluster
from kvstore.keys import block_hashes
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.config import RouterConfig
from router.routing.migrate import Progress, WorkerLost, read_until_lost

SALT = bytes(16)


def _prompt() -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r1", token_ids=pb.TokenIds(ids=[1, 2, 3, 4, 5]),
                              sampling=pb.SamplingParams(max_tokens=10, seed=7, temperature=0.5, stop=["x"]))


def test_resubmission_carries_the_streamed_tokens_and_the_same_params() -> None:
    p = Progress(_prompt(), limit=3, started=0.0)
    p.note(pb.GenerateResponse(token_ids=[9, 8]))
    p.note(pb.GenerateResponse(token_ids=[7]))
    request, route = p.resubmit(block_size=4, salt=SALT)
    assert list(request.token_ids.ids) == [1, 2, 3, 4, 5, 9, 8, 7] and request.resume_tokens == 3
    assert request.sampling == _prompt().sampling and request.request_id == "r1"
    assert route.token_ids == (1, 2, 3, 4, 5, 9, 8, 7)
    assert list(route.block_hashes) == block_hashes(list(route.token_ids), 4, SALT)
    assert (p.resubmits, p.migrations) == (1, 1)
    assert list(p.prompt.token_ids.ids) == [1, 2, 3, 4, 5]       # the original is untouched


@pytest.mark.parametrize("limit,streamed,allowed", [(0, False, 1), (0, True, 0), (3, True, 3), (3, False, 3)])
def test_the_limit_bounds_resubmissions(limit: int, streamed: bool, allowed: int) -> None:
    p = Progress(_prompt(), limit=limit, started=0.0)
    if streamed:
        p.note(pb.GenerateResponse(token_ids=[9]))
    n = 0
    while p.may_resubmit():
        p.resubmit(4, SALT)
        n += 1
    assert n == allowed
    request, _ = Progress(_prompt(), limit=limit, started=0.0).resubmit(4, SALT)
    assert request.resume_tokens == 0      # nothing streamed: the same request again


class _FakeCall:
    """A call whose responses arrive when the test releases them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()

    async def read(self) -> object:
        return await self.queue.get()


def test_a_lost_worker_cuts_its_stream_and_eof_ends_it() -> None:
    async def run() -> tuple[list[pb.GenerateResponse], bool, list[pb.GenerateResponse]]:
        call, lost = _FakeCall(), asyncio.Event()
        got = []
        call.queue.put_nowait(pb.GenerateResponse(token_ids=[1]))
        cut = False
        try:
            async for r in read_until_lost(call, lost):  # type: ignore[arg-type]
                got.append(r)
                lost.set()       # the registry found it unreachable; no more responses come
        except WorkerLost:
            cut = True
        call2 = _FakeCall()
        for item in (pb.GenerateResponse(token_ids=[2]), grpc.aio.EOF):
            call2.queue.put_nowait(item)
        whole = [r async for r in read_until_lost(call2, asyncio.Event())]  # type: ignore[arg-type]
        return got, cut, whole
    got, cut, whole = asyncio.run(run())
    assert [list(r.token_ids) for r in got] == [[1]] and cut
    assert [list(r.token_ids) for r in whole] == [[2]]


def test_config_and_flags() -> None:
    with pytest.raises(ValueError, match="migration_limit"):
        RouterConfig(migration_limit=-1)
    with pytest.raises(ValueError, match="drain_timeout_s"):
        RouterConfig(drain_timeout_s=-1.0)
    from contracts.cli import CLIError
    from kvmesh.cli import build_parser
    from kvmesh.serve.cli import config_from_args
    with pytest.raises(CLIError, match="--migration-limit"):
        config_from_args(build_parser().parse_args(["serve", "--migration-limit", "-2"]))
    serve = config_from_args(build_parser().parse_args(["serve", "--migration-limit", "5"]))
    argv = Cluster(serve, placement=None)._router_argv(1, 2)  # type: ignore[arg-type]
    assert argv[argv.index("--migration-limit") + 1] == "5"
    args = build_parser().parse_args(["router", "--migration-limit", "0", "--drain-timeout", "2.5"])
    assert (args.migration_limit, args.drain_timeout_s) == (0, 2.5)
    assert build_parser().parse_args(["serve", "--migration-limit", "1"]).migration_limit == 1
    with pytest.raises(ValueError, match="only"):
        ChaosConfig(only=("nope",))
    with pytest.raises(ValueError, match="workers"):
        ChaosConfig(workers=2)
