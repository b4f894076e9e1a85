from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "min_tokens", "truncate_prompt_tokens", "logprobs", "prompt_logprobs", "n", "best_of")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    min_tokens: int
    truncate_prompt_tokens: int
    logprobs: int
    prompt_logprobs: int
    n: int
    best_of: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ...) -> None: ...

class LogprobEntry(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[LogprobEntry]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[LogprobEntry, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class PeerHint(_message.Message):
    __slots__ = ("worker_id", "address", "num_blocks", "rank", "handoff", "timeout_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    num_blocks: int
    rank: int
    handoff: bool
    timeout_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., rank: _Optional[int] = ..., handoff: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class TenantShare(_message.Message):
    __slots__ = ("name", "weight", "max_cached_blocks", "busy_tenants")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BUSY_TENANTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    max_cached_blocks: int
    busy_tenants: int
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., max_cached_blocks: _Optional[int] = ..., busy_tenants: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "priority", "peer_hints", "cache_salt", "tenant", "resume_tokens", "prefill_only", "shared_prefix_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PEER_HINTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    priority: int
    peer_hints: _containers.RepeatedCompositeFieldContainer[PeerHint]
    cache_salt: str
    tenant: TenantShare
    resume_tokens: int
    prefill_only: bool
    shared_prefix_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., peer_hints: _Optional[_Iterable[_Union[PeerHint, _Mapping]]] = ..., cache_salt: _Optional[str] = ..., tenant: _Optional[_Union[TenantShare, _Mapping]] = ..., resume_tokens: _Optional[int] = ..., prefill_only: _Optional[bool] = ..., shared_prefix_blocks: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "worker_id", "peer_cached_tokens", "index", "logprobs", "prompt_logprobs", "sequence_finished", "cumulative_logprob", "migrations", "prefilled_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FINISHED_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    worker_id: str
    peer_cached_tokens: int
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    sequence_finished: bool
    cumulative_logprob: float
    migrations: int
    prefilled_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., worker_id: _Optional[str] = ..., peer_cached_tokens: _Optional[int] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., sequence_finished: _Optional[bool] = ..., cumulative_logprob: _Optional[float] = ..., migrations: _Optional[int] = ..., prefilled_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "block_size", "kv_cache_dtype", "eos_token_ids", "hash_salt_hex", "attention_backend", "tokenizer_sha256")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HASH_SALT_HEX_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    kv_cache_dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    hash_salt_hex: str
    attention_backend: str
    tokenizer_sha256: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., hash_salt_hex: _Optional[str] = ..., attention_backend: _Optional[str] = ..., tokenizer_sha256: _Optional[str] = ...) -> None: ...

class TokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("model", "hash_salt_hex", "sha256", "files")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HASH_SALT_HEX_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    model: str
    hash_salt_hex: str
    sha256: str
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, model: _Optional[str] = ..., hash_salt_hex: _Optional[str] = ..., sha256: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("worker_id", "num_running", "num_waiting", "num_free_blocks", "num_used_blocks", "num_blocks", "prefix_query_blocks", "prefix_hit_blocks", "prompt_tokens", "cached_prompt_tokens", "num_preemptions", "peer", "num_host_blocks", "host_num_blocks", "num_onloaded_blocks", "num_cached_blocks", "num_offloaded_blocks", "num_protected_blocks", "num_reused_blocks", "disk_read_bytes_s", "blocks_handed_over", "blocks_warmed", "handover_room_blocks", "disk_read_cost_ratio", "role", "prefill_only_requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ONLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROTECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_REUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_WARMED_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_ROOM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ONLY_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_used_blocks: int
    num_blocks: int
    prefix_query_blocks: int
    prefix_hit_blocks: int
    prompt_tokens: int
    cached_prompt_tokens: int
    num_preemptions: int
    peer: PeerStats
    num_host_blocks: int
    host_num_blocks: int
    num_onloaded_blocks: int
    num_cached_blocks: int
    num_offloaded_blocks: int
    num_protected_blocks: int
    num_reused_blocks: int
    disk_read_bytes_s: float
    blocks_handed_over: int
    blocks_warmed: int
    handover_room_blocks: int
    disk_read_cost_ratio: float
    role: str
    prefill_only_requests: int
    def __init__(self, worker_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., prefix_query_blocks: _Optional[int] = ..., prefix_hit_blocks: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., peer: _Optional[_Union[PeerStats, _Mapping]] = ..., num_host_blocks: _Optional[int] = ..., host_num_blocks: _Optional[int] = ..., num_onloaded_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_offloaded_blocks: _Optional[int] = ..., num_protected_blocks: _Optional[int] = ..., num_reused_blocks: _Optional[int] = ..., disk_read_bytes_s: _Optional[float] = ..., blocks_handed_over: _Optional[int] = ..., blocks_warmed: _Optional[int] = ..., handover_room_blocks: _Optional[int] = ..., disk_read_cost_ratio: _Optional[float] = ..., role: _Optional[str] = ..., prefill_only_requests: _Optional[int] = ...) -> None: ...

class PeerLink(_message.Message):
    __slots__ = ("rank", "bandwidth_bytes_s", "latency_s", "lost", "worker_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    bandwidth_bytes_s: float
    latency_s: float
    lost: str
    worker_id: str
    def __init__(self, rank: _Optional[int] = ..., bandwidth_bytes_s: _Optional[float] = ..., latency_s: _Optional[float] = ..., lost: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class PeerStats(_message.Message):
    __slots__ = ("rank", "world_size", "backend", "prefill_tokens_per_s", "checksum_bytes_s", "links", "fetch_decisions", "recompute_decisions", "blocks_fetched", "bytes_fetched", "blocks_bad", "fetch_failures", "blocks_sent", "bytes_sent", "send_failures", "fetch_seconds", "last_decision", "last_fetch_estimate_s", "last_recompute_estimate_s", "worker_id", "generation", "store_address", "pairs_formed", "pairs_broken")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_BYTES_S_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    FETCH_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FETCHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_BAD_FIELD_NUMBER: _ClassVar[int]
    FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    SEND_FAILURES_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    LAST_FETCH_ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_RECOMPUTE_ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FORMED_FIELD_NUMBER: _ClassVar[int]
    PAIRS_BROKEN_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    backend: str
    prefill_tokens_per_s: float
    checksum_bytes_s: float
    links: _containers.RepeatedCompositeFieldContainer[PeerLink]
    fetch_decisions: int
    recompute_decisions: int
    blocks_fetched: int
    bytes_fetched: int
    blocks_bad: int
    fetch_failures: int
    blocks_sent: int
    bytes_sent: int
    send_failures: int
    fetch_seconds: float
    last_decision: str
    last_fetch_estimate_s: float
    last_recompute_estimate_s: float
    worker_id: str
    generation: int
    store_address: str
    pairs_formed: int
    pairs_broken: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., prefill_tokens_per_s: _Optional[float] = ..., checksum_bytes_s: _Optional[float] = ..., links: _Optional[_Iterable[_Union[PeerLink, _Mapping]]] = ..., fetch_decisions: _Optional[int] = ..., recompute_decisions: _Optional[int] = ..., blocks_fetched: _Optional[int] = ..., bytes_fetched: _Optional[int] = ..., blocks_bad: _Optional[int] = ..., fetch_failures: _Optional[int] = ..., blocks_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., send_failures: _Optional[int] = ..., fetch_seconds: _Optional[float] = ..., last_decision: _Optional[str] = ..., last_fetch_estimate_s: _Optional[float] = ..., last_recompute_estimate_s: _Optional[float] = ..., worker_id: _Optional[str] = ..., generation: _Optional[int] = ..., store_address: _Optional[str] = ..., pairs_formed: _Optional[int] = ..., pairs_broken: _Optional[int] = ...) -> None: ...

class SendBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "dst_rank", "src_rank", "transfer_id", "pair_key", "new_pair", "store_address", "receiver_id", "receiver_generation", "sender_id", "sender_generation")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PAIR_KEY_FIELD_NUMBER: _ClassVar[int]
    NEW_PAIR_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    dst_rank: int
    src_rank: int
    transfer_id: int
    pair_key: str
    new_pair: bool
    store_address: str
    receiver_id: str
    receiver_generation: int
    sender_id: str
    sender_generation: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., dst_rank: _Optional[int] = ..., src_rank: _Optional[int] = ..., transfer_id: _Optional[int] = ..., pair_key: _Optional[str] = ..., new_pair: _Optional[bool] = ..., store_address: _Optional[str] = ..., receiver_id: _Optional[str] = ..., receiver_generation: _Optional[int] = ..., sender_id: _Optional[str] = ..., sender_generation: _Optional[int] = ...) -> None: ...

class SendBlocksResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "reason", "generation", "pair_unknown")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PAIR_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    reason: str
    generation: int
    pair_unknown: bool
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., reason: _Optional[str] = ..., generation: _Optional[int] = ..., pair_unknown: _Optional[bool] = ...) -> None: ...

class HotBlocksRequest(_message.Message):
    __slots__ = ("max_blocks",)
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    max_blocks: int
    def __init__(self, max_blocks: _Optional[int] = ...) -> None: ...

class HotBlocksResponse(_message.Message):
    __slots__ = ("block_hashes", "generation")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    generation: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., generation: _Optional[int] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "sender_id", "sender_address")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    sender_id: str
    sender_address: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., sender_id: _Optional[str] = ..., sender_address: _Optional[str] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("num_blocks", "reason")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    reason: str
    def __init__(self, num_blocks: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset",)
    RESET_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    def __init__(self, reset: _Optional[bool] = ...) -> None: ...

class AttestRequest(_message.Message):
    __slots__ = ("nonce",)
    NONCE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    def __init__(self, nonce: _Optional[bytes] = ...) -> None: ...

class AttestResponse(_message.Message):
    __slots__ = ("worker_id", "address", "mac")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    mac: bytes
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., mac: _Optional[bytes] = ...) -> None: ...
