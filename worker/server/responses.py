"""The Worker's gRPC answers built from engine data: one engine output as a `GenerateResponse`
(what every streamed response carries; the server adds the usage figures to the group's last
one), an engine snapshot as `Load`, the tokenizer files as `TokenizerFiles`. Torch-free: the
router's CLI imports the worker server."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from contracts.wire import FINISH_REASONS
from proto.kvmesh.v1 import kvmesh_pb2 as pb

if TYPE_CHECKING:
    from worker.engine.config import EngineStats
    from worker.engine.request import RequestOutput, TokenLogprob
    from worker.peer.config import PeerFigures

LOAD_WAIT_S = 0.5        # GetLoad: past this mid-step, the figures of the last step (AsyncEngine.snapshot)


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


def handover_room(s: EngineStats) -> int:
    """Host-tier blocks a draining peer's hand-over may fill on this worker now (Load's
    handover_room_blocks, PullBlocks' bound): the free ones; with a disk tier on, every one — a
    block the hand-over displaces goes to the disk tier as any host eviction does (or is there
    already, written through), so taking a leaving peer's hottest blocks throws none away."""
    if s.disk is not None and s.disk.enabled:
        return s.host_num_blocks
    return max(0, s.host_num_blocks - s.num_host_blocks)


PREFILL_PROBE_TOKENS = 64      # the start-up prefill probe a disk read is priced against (as the peer plane's)


def disk_read_cost_ratio(payload_bytes: int, read_bytes_s: float, block_size: int, prefill_tokens_s: float) -> float:
    """Load's disk_read_cost_ratio: reading one block back from the disk tier (its payload at
    the measured read speed) over computing its `block_size` tokens at the measured prefill
    rate; 0 while either rate is unmeasured (the router then prices a disk hit as a host hit)."""
    if read_bytes_s <= 0 or prefill_tokens_s <= 0 or block_size <= 0:
        return 0.0
    return (payload_bytes / read_bytes_s) / (block_size / prefill_tokens_s)


def load_response(worker_id: str, s: EngineStats, prompt_tokens: int, cached_prompt_tokens: int,
                  peer: PeerFigures | None) -> pb.Load:
    """GetLoad's answer: an engine snapshot, the server's token totals, the peer plane's figures."""
    load = pb.Load(worker_id=worker_id, num_running=s.num_running, num_waiting=s.num_waiting,
                   num_free_blocks=s.num_free_blocks, num_used_blocks=s.num_used_blocks,
                   num_blocks=s.num_blocks, prefix_query_blocks=s.prefix_queries,
                   prefix_hit_blocks=s.prefix_hits, prompt_tokens=prompt_tokens,
                   cached_prompt_tokens=cached_prompt_tokens, num_preemptions=s.num_preemptions,
                   num_host_blocks=s.num_host_blocks, host_num_blocks=s.host_num_blocks,
                   num_onloaded_blocks=s.num_onloaded_blocks,
                   num_cached_blocks=s.num_cached_blocks, num_offloaded_blocks=s.num_offloaded_blocks,
                   num_protected_blocks=s.num_protected_blocks, num_reused_blocks=s.num_reused_blocks,
                   handover_room_blocks=handover_room(s))
    if peer is not None:
        load.peer.CopyFrom(peer_stats(peer))
    return load


def peer_stats(f: PeerFigures) -> pb.PeerStats:
    links = [pb.PeerLink(worker_id=w, bandwidth_bytes_s=e.bandwidth_bytes_s if e else 0.0,
                         latency_s=e.latency_s if e else 0.0, lost=f.lost.get(w, ""))
             for w in sorted(f.links.keys() | f.lost.keys()) for e in (f.links.get(w),)]
    return pb.PeerStats(
        worker_id=f.me.worker_id, generation=f.me.generation, store_address=f.store_address,
        pairs_formed=f.pairs_formed, pairs_broken=f.pairs_broken, backend=f.backend,
        prefill_tokens_per_s=f.prefill_tokens_per_s, checksum_bytes_s=f.checksum_bytes_s, links=links,
        **dataclasses.asdict(f.counters))


def tokenizer_response(model: str, hash_salt_hex: str, files: Mapping[str, bytes], sha256: str) -> pb.TokenizerFiles:
    """GetTokenizer's answer; `sha256` = contracts.tokenizer.tokenizer_files_digest(files)."""
    return pb.TokenizerFiles(model=model, hash_salt_hex=hash_salt_hex, sha256=sha256, files=dict(files))
