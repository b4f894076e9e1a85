"""Malformed and out-of-range Generate requests to the router over gRPC (one real SmolLM2 worker
behind it, the `web` fixture): each gets its status code and details, and the router keeps serving.
Rejected by the router before any worker sees it, except "worker rejects", which the worker refuses
and the router passes through.
"""
from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from proto.kvmesh.v1 import kvmesh_pb2 as pb
from tests.router.test_router import Cluster, greedy, run_generate, summary


@pytest.fixture
def router_channel(web: Cluster) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{web.grpc_port}") as ch:
        yield ch


def _raw(text: str = "hi") -> bytes:
    return pb.GenerateRequest(text=text, sampling=greedy(2)).SerializeToString()


BAD_REQUESTS: dict[str, tuple[bytes, grpc.StatusCode]] = {
    "empty text": (pb.GenerateRequest(text="", sampling=greedy()).SerializeToString(),
                   grpc.StatusCode.INVALID_ARGUMENT),
    "no input": (pb.GenerateRequest(sampling=greedy()).SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT),
    "empty token_ids": (b"\x1a\x00",
                        grpc.StatusCode.INVALID_ARGUMENT),
    "text and token_ids": (_raw() + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])).SerializeToString(),
                           grpc.StatusCode.INVALID_ARGUMENT),
    "token id over vocab": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 10**6])).SerializeToString(),
                            grpc.StatusCode.INVALID_ARGUMENT),
    "negative token id": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, -1])).SerializeToString(),
                          grpc.StatusCode.INVALID_ARGUMENT),
    "prompt over max_model_len": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * 9000)).SerializeToString(),
                                  grpc.StatusCode.INVALID_ARGUMENT),
    "max_tokens 0": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)).SerializeToString(),
                     grpc.StatusCode.INVALID_ARGUMENT),
    "max_tokens -3": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=-3)).SerializeToString(),
                      grpc.StatusCode.INVALID_ARGUMENT),
    "NaN temperature": (pb.GenerateRequest(text="hi",
                                           sampling=pb.SamplingParams(temperature=float("nan"))).SerializeToString(),
                        grpc.StatusCode.INVALID_ARGUMENT),
    "negative temperature": (pb.GenerateRequest(text="hi",
                                                sampling=pb.SamplingParams(temperature=-1)).SerializeToString(),
                             grpc.StatusCode.INVALID_ARGUMENT),
    "top_p 0": (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)).SerializeToString(),
                grpc.StatusCode.INVALID_ARGUMENT),
    "bad chat role": (pb.GenerateRequest(chat=pb.ChatMessages(
                          messages=[pb.ChatMessage(role="tool", content="x")])).SerializeToString(),
                      grpc.StatusCode.INVALID_ARGUMENT),
    "unknown field": (_raw() + b"\x98\x06\x01", grpc.StatusCode.INVALID_ARGUMENT),
    "invalid utf-8": (b"\x12\x02\xff\xfe", grpc.StatusCode.INVALID_ARGUMENT),
    "10 MB message": (_raw("x" * (10 * 2**20)), grpc.StatusCode.RESOURCE_EXHAUSTED),
    # Rejected by the worker (a stop token id outside the vocabulary): passed through.
    "worker rejects": (pb.GenerateRequest(text="hi",
                                          sampling=pb.SamplingParams(stop_token_ids=[10**6])).SerializeToString(),
                       grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.server
@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_its_status_and_router_keeps_serving(router_channel: grpc.Channel, case: str) -> None:
    raw, code = BAD_REQUESTS[case]
    generate = router_channel.unary_stream("/kvmesh.v1.Router/Generate", request_serializer=lambda b: b,
                                           response_deserializer=pb.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as err:
        list(generate(raw, timeout=30))
    assert err.value.code() == code, err.value.details()
    assert err.value.details()
    if case == "worker rejects":
        assert "stop_token_ids" in err.value.details()
    ids, _, last = summary(run_generate(router_channel, pb.GenerateRequest(text="Hello", sampling=greedy(2))))
    assert len(ids) == 2 and last.finished
