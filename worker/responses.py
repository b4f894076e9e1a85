"""One engine output as the Worker's gRPC `GenerateResponse` (what every streamed response
carries; the server adds the usage figures to the group's last one). Torch-free: the router's
CLI imports the worker server."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from contracts.wire import FINISH_REASONS
from proto.kvmesh.v1 import kvmesh_pb2 as pb

if TYPE_CHECKING:
    from worker.request import RequestOutput, TokenLogprob


def stream_response(out: RequestOutput, worker_id: str) -> pb.GenerateResponse:
    """Tokens, text, sequence index and logprobs of `out`; a finished sequence's reason."""
    resp = pb.GenerateResponse(request_id=out.request_id, token_ids=out.new_token_ids,
                               text=out.new_text, worker_id=worker_id, index=out.index,
                               logprobs=to_pb(out.new_logprobs), prompt_logprobs=to_pb(out.prompt_logprobs or ()),
                               cumulative_logprob=out.cumulative_logprob or 0.0)
    if out.finished:
        resp.sequence_finished = True
        resp.finish_reason = FINISH_REASONS.get(out.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED)
    return resp


def to_pb(logprobs: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.LogprobEntry(token_id=t, logprob=v) for t, v in lp.top]) for lp in logprobs]
