"""The protobuf edge: GenerateRequest bytes → a validated `GenerateInput` dataclass
(contracts/requests.py), and back.

Shared by the router and the worker servers so both reject the same bad input the same way
(`BadRequest` → gRPC INVALID_ARGUMENT). torch-free.

Parsing is strict where protobuf is lenient: a message naming more than one member of the
`input` oneof (protobuf would silently keep the last), unknown fields, and invalid UTF-8
are all errors, not guesses.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message

from contracts.requests import (
    MAX_CACHE_SALT_CHARS,
    MAX_PAIR_KEY,
    MAX_SEND_BLOCKS,
    BadRequest,
    ChatMessage,
    GenerateInput,
    PeerHint,
    SendBlocksInput,
    TenantShare,
)
from contracts.sampling import SamplingParams, SamplingParamsError
from proto.kvmesh.v1 import kvmesh_pb2 as pb

_INPUT_FIELDS = {2: "text", 3: "token_ids", 4: "chat"}
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}

# SamplingParams fields carried by the proto; unset `optional` fields keep the dataclass default.
_SCALAR_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "ignore_eos",
                    "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                    "min_tokens", "truncate_prompt_tokens", "logprobs", "prompt_logprobs", "n", "best_of")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the strict deserializer hands the handler: the message, or why it is unusable."""

    message: pb.GenerateRequest | None
    error: str | None


def parse_generate_request(raw: bytes) -> ParsedRequest:
    """gRPC request_deserializer for Generate: never raises (gRPC would answer INTERNAL)."""
    try:
        msg = pb.GenerateRequest.FromString(raw)
    except DecodeError as e:
        return ParsedRequest(None, f"malformed request: {e}")
    present = _top_level_fields(raw) & set(_INPUT_FIELDS)
    if len(present) > 1:
        names = " and ".join(_INPUT_FIELDS[n] for n in sorted(present))
        return ParsedRequest(None, f"input: set exactly one of text, token_ids, chat (got {names})")
    unknown = _unknown_field_numbers(msg)
    if unknown:
        return ParsedRequest(None, f"unknown fields {sorted(unknown)} in GenerateRequest")
    return ParsedRequest(msg, None)


def to_generate_input(msg: pb.GenerateRequest, default_max_tokens: int = 256) -> GenerateInput:
    """Validate a parsed GenerateRequest; raises BadRequest naming the field."""
    kind = msg.WhichOneof("input")
    if kind is None:
        raise BadRequest("input: set one of text, token_ids, chat")
    text = token_ids = chat = None
    if kind == "text":
        if not msg.text:
            raise BadRequest("text: the prompt is empty")
        text = msg.text
    elif kind == "token_ids":
        if not msg.token_ids.ids:
            raise BadRequest("token_ids: the prompt is empty")
        token_ids = tuple(msg.token_ids.ids)
    else:
        if not msg.chat.messages:
            raise BadRequest("chat: no messages")
        chat = tuple(ChatMessage(m.role, m.content) for m in msg.chat.messages)
        for m in chat:
            if m.role not in ("system", "user", "assistant"):
                raise BadRequest(f"chat.role: {m.role!r}; accepted: system, user, assistant")
    if len(msg.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"cache_salt: {len(msg.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
    resume = msg.resume_tokens
    if resume and (token_ids is None or not 0 < resume < len(token_ids)):
        raise BadRequest(f"resume_tokens: {resume} must be in [0, len(token_ids)) and needs token_ids")
    if msg.shared_prefix_blocks < 0:
        raise BadRequest(f"shared_prefix_blocks: {msg.shared_prefix_blocks} must be >= 0")
    return GenerateInput(msg.request_id, text, token_ids, chat,
                         to_sampling_params(msg.sampling, default_max_tokens), msg.priority,
                         tuple(_peer_hint(i, h) for i, h in enumerate(msg.peer_hints)),
                         msg.cache_salt, msg.sampling.HasField("max_tokens"), resume, _tenant(msg.tenant),
                         msg.prefill_only, msg.shared_prefix_blocks)


def _tenant(t: pb.TenantShare) -> TenantShare:
    if len(t.name) > MAX_CACHE_SALT_CHARS:
        raise BadRequest(f"tenant.name: {len(t.name)} characters; at most {MAX_CACHE_SALT_CHARS}")
    if t.weight < 0 or t.weight != t.weight or t.max_cached_blocks < 0 or t.busy_tenants < 0:
        raise BadRequest("tenant: weight, max_cached_blocks and busy_tenants must be >= 0")
    return TenantShare(t.name, t.weight or 1.0, t.max_cached_blocks or None, t.busy_tenants)


def to_tenant_share(t: TenantShare) -> pb.TenantShare:
    """The wire form of `t` (router -> worker)."""
    return pb.TenantShare(name=t.name, weight=t.weight, max_cached_blocks=t.max_cached_blocks or 0,
                          busy_tenants=t.busy_tenants)


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) <= 65535)


def _peer_hint(i: int, h: pb.PeerHint) -> PeerHint:
    if not _is_host_port(h.address):
        raise BadRequest(f"peer_hints[{i}].address: {h.address!r} is not HOST:PORT")
    if h.num_blocks < 0:
        raise BadRequest(f"peer_hints[{i}].num_blocks: {h.num_blocks} must be >= 0")
    if h.handoff and not (h.timeout_s > 0 and math.isfinite(h.timeout_s)):
        raise BadRequest(f"peer_hints[{i}].timeout_s: {h.timeout_s} must be > 0 with handoff")
    return PeerHint(h.worker_id, h.address, h.num_blocks, h.handoff, h.timeout_s if h.handoff else 0.0)


def to_peer_hint(h: PeerHint) -> pb.PeerHint:
    return pb.PeerHint(worker_id=h.worker_id, address=h.address, num_blocks=h.num_blocks, handoff=h.handoff,
                       timeout_s=h.timeout_s)


def parse_send_blocks_request(raw: bytes) -> pb.SendBlocksRequest | str:
    """gRPC request_deserializer for SendBlocks: the message, or why it is unusable (never raises)."""
    try:
        msg = pb.SendBlocksRequest.FromString(raw)
    except DecodeError as e:
        return f"malformed request: {e}"
    unknown = _unknown_field_numbers(msg)
    return f"unknown fields {sorted(unknown)} in SendBlocksRequest" if unknown else msg


def to_send_blocks_input(msg: pb.SendBlocksRequest) -> SendBlocksInput:
    """Validate a SendBlocksRequest (its rank fields are not read: pairs form on demand);
    raises BadRequest naming the field."""
    if not msg.block_hashes:
        raise BadRequest("block_hashes: empty")
    if len(msg.block_hashes) > MAX_SEND_BLOCKS:
        raise BadRequest(f"block_hashes: {len(msg.block_hashes)} hashes; at most {MAX_SEND_BLOCKS}")
    bad = next((i for i, h in enumerate(msg.block_hashes) if len(h) != 16), None)
    if bad is not None:
        raise BadRequest(f"block_hashes[{bad}]: {len(msg.block_hashes[bad])} bytes; a block hash has 16")
    for name in ("transfer_id", "receiver_generation", "sender_generation"):
        if getattr(msg, name) < 0:
            raise BadRequest(f"{name}: {getattr(msg, name)} must be >= 0")
    if not 0 < len(msg.pair_key) <= MAX_PAIR_KEY or not msg.pair_key.isprintable() or " " in msg.pair_key:
        raise BadRequest(f"pair_key: {msg.pair_key[:MAX_PAIR_KEY]!r} must be 1-{MAX_PAIR_KEY} printable "
                         "characters without spaces")
    if not _is_host_port(msg.store_address):
        raise BadRequest(f"store_address: {msg.store_address[:100]!r} is not HOST:PORT")
    if not msg.receiver_id or len(msg.receiver_id) > MAX_PAIR_KEY or any(c.isspace() for c in msg.receiver_id):
        raise BadRequest(f"receiver_id: {msg.receiver_id[:MAX_PAIR_KEY]!r} must be a worker id")
    hashes = tuple(int.from_bytes(h, "big") for h in msg.block_hashes)
    return SendBlocksInput(hashes, msg.transfer_id, msg.pair_key, msg.new_pair,
                           msg.store_address, msg.receiver_id, msg.receiver_generation, msg.sender_id,
                           msg.sender_generation)


def to_send_blocks_request(block_hashes: Sequence[int], transfer_id: int, **pair: object) -> pb.SendBlocksRequest:
    """`pair`: the pair fields of SendBlocksRequest (pair_key, new_pair, store_address, ...)."""
    return pb.SendBlocksRequest(block_hashes=[h.to_bytes(16, "big") for h in block_hashes],
                                transfer_id=transfer_id, **pair)  # type: ignore[arg-type]


def to_sampling_params(sp: pb.SamplingParams, default_max_tokens: int = 256) -> SamplingParams:
    kwargs: dict[str, object] = {"max_tokens": default_max_tokens}
    for name in _SCALAR_SAMPLING:
        if sp.HasField(name):
            value = getattr(sp, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise BadRequest(f"sampling.{name}: must be finite, got {value}")
            kwargs[name] = value
    if sp.stop:
        kwargs["stop"] = tuple(sp.stop)
    if sp.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(sp.stop_token_ids)
    try:
        return SamplingParams(**kwargs)  # type: ignore[arg-type]
    except SamplingParamsError as e:
        raise BadRequest(f"sampling.{e}") from None


def from_sampling_params(p: SamplingParams) -> pb.SamplingParams:
    sp = pb.SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids))
    for name in _SCALAR_SAMPLING:
        value = getattr(p, name)
        if value is not None:
            setattr(sp, name, value)
    return sp


def _unknown_field_numbers(msg: Message) -> set[int]:
    """Field numbers this build of the contract does not know, in msg and nested messages."""
    unknown = unknown_fields.UnknownFieldSet(msg)
    numbers = {unknown[i].field_number for i in range(len(unknown))}
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        for item in (value if fd.is_repeated else [value]):
            numbers |= _unknown_field_numbers(item)
    return numbers


def _top_level_fields(raw: bytes) -> set[int]:
    """Field numbers present at the top level of a serialized message (wire-format walk)."""
    seen: set[int] = set()
    i, n = 0, len(raw)
    while i < n:
        key, i = _varint(raw, i)
        number, wire = key >> 3, key & 7
        seen.add(number)
        if wire == 0:
            _, i = _varint(raw, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            length, i = _varint(raw, i)
            i += length
        elif wire == 5:
            i += 4
        else:  # groups are not used by this contract; FromString already accepted the bytes
            break
    return seen


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = raw[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
