"""What an `Engine` is built from (`EngineConfig`) and what it reports (`EngineStats`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from worker.engine.eviction import EvictionConfig, EvictionPolicy
from worker.kernels.backend import parse_backend

if TYPE_CHECKING:
    from kvstore.disk_stats import DiskTierStats

DTYPE_NAMES = ("fp32", "fp16", "bf16")
# how the linear weights and the embedding are held on CPU (worker.model.formats)
WEIGHT_DTYPE_NAMES = ("auto", "fp32", "bf16", "q8_0", "q4_0", "q4_1")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"
    dtype: str = "auto"                   # auto: fp32 on CPU, bf16 on CUDA
    weight_dtype: str = "auto"            # CPU: auto (the checkpoint's own) | fp32 | bf16 | q8_0 | q4_0 | q4_1
    device: str = "auto"
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_gib: float = 1.0      # KV pool size, unless num_blocks is given
    num_blocks: int | None = None
    memory_gib: float | None = None       # weights + KV pool + activations; the pool gets what the weights leave
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None      # default: the model's max_position_embeddings
    max_queue_len: int = 4096
    fair_share: bool = True               # tenants share prefill by weight (worker.engine.fairness)
    fair_step_tokens: int = 16            # prefill tokens per step while tenants contend
    tenant_max_cached_frac: float = 0.5   # a tenant's cap on cached blocks in each tier (kvstore.quota)
    step_prefill_tokens: int = 0          # prefill tokens per step beside the decodes (0: max_num_batched_tokens)
    room_wait_steps: int = 32             # steps an admission may wait to keep a shared prefix (0: never)
    check_integrity: bool = False         # run the KV store's integrity check after every step
    kv_offload_gib: float = 0.0           # host-memory tier behind the KV pool (0: none)
    kv_disk_path: str | None = None       # directory of the disk tier below the host tier (None: none)
    kv_disk_gib: float = 0.0              # the disk tier's size bound (GiB of records)
    kv_disk_write_through: bool = True    # every cached block to the disk tier at once (kvstore DiskSpec)
    kv_eviction: str = "none"             # token eviction inside sequences: none | streaming | h2o
    kv_budget: int | None = None          # tokens each sequence keeps under kv_eviction
    attention_sinks: int = 4              # first tokens always kept under kv_eviction
    h2o_decay: float = 0.98               # h2o: per-query decay of the attention each token received
    kv_calibration: bool = True           # int4: per-channel key scales and shift from a calibration text
    attention_backend: str = "auto"       # auto | torch | native | triton (worker.kernels.backend)
    enforce_eager: bool = False           # CUDA: no decode CUDA graphs (vLLM's flag; worker.model.cuda_graph)
    threads: int = 0                      # CPU threads for the engine's ops (torch.set_num_threads); 0: torch's

    def __post_init__(self) -> None:
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"threads={self.threads!r} must be an integer >= 0 (0 = every core)")
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise ValueError(f"dtype={self.dtype!r}; accepted: auto, fp32, fp16, bf16")
        if self.weight_dtype not in WEIGHT_DTYPE_NAMES:
            raise ValueError(f"weight_dtype={self.weight_dtype!r}; accepted: {', '.join(WEIGHT_DTYPE_NAMES)}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r}; accepted: auto, cpu, cuda[:N]")
        if not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib={self.kv_cache_memory_gib} must be > 0")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks={self.num_blocks} must be positive")
        if self.memory_gib is not None and not self.memory_gib > 0:
            raise ValueError(f"memory_gib={self.memory_gib} must be > 0")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be > 1")
        if not self.kv_offload_gib >= 0:
            raise ValueError(f"kv_offload_gib={self.kv_offload_gib} must be >= 0")
        if self.kv_offload_gib > 0 and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gib needs prefix caching: the host tier keys blocks by hash")
        if not self.kv_disk_gib >= 0:
            raise ValueError(f"kv_disk_gib={self.kv_disk_gib} must be >= 0")
        if (self.kv_disk_gib > 0) != bool(self.kv_disk_path):
            raise ValueError(f"kv_disk_path={self.kv_disk_path!r} and kv_disk_gib={self.kv_disk_gib} go together: "
                             "a directory and a size > 0 turn the disk tier on")
        if self.kv_disk_gib > 0 and not self.kv_offload_gib > 0:
            raise ValueError("kv_disk_gib needs kv_offload_gib > 0: the disk tier writes what the host tier evicts")
        if self.kv_eviction not in ("none", "streaming", "h2o"):
            raise ValueError(f"kv_eviction={self.kv_eviction!r}; accepted: none, streaming, h2o")
        self.eviction_config()  # validates kv_budget / attention_sinks against the policy
        parse_backend(self.attention_backend)  # the name; whether it runs on the device: Engine
        if isinstance(self.step_prefill_tokens, bool) or not isinstance(self.step_prefill_tokens, int) \
                or self.step_prefill_tokens < 0:
            raise ValueError(f"step_prefill_tokens={self.step_prefill_tokens!r} must be an integer >= 0 (0 = no cap)")
        if isinstance(self.room_wait_steps, bool) or not isinstance(self.room_wait_steps, int) \
                or self.room_wait_steps < 0:
            raise ValueError(f"room_wait_steps={self.room_wait_steps!r} must be an integer >= 0 (0 = never wait)")
        if self.max_queue_len <= 0:
            raise ValueError(f"max_queue_len={self.max_queue_len} must be positive")

    def eviction_config(self) -> EvictionConfig:
        return EvictionConfig(EvictionPolicy(self.kv_eviction), self.kv_budget, self.attention_sinks,
                              self.block_size, self.h2o_decay)


class EngineStats(NamedTuple):
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_used_blocks: int
    num_blocks: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    num_host_blocks: int = 0          # host-tier blocks in use / in all
    host_num_blocks: int = 0
    num_onloaded_blocks: int = 0      # blocks admitted from the host tier
    num_offloaded_blocks: int = 0     # blocks copied into the host tier from the device pool
    num_lru_evicted_blocks: int = 0   # cached device blocks dropped (reused) by allocations
    num_evicted_tokens: int = 0       # tokens dropped by token eviction (kv_eviction)
    num_cached_blocks: int = 0        # device blocks holding a cached prefix (in use or free)
    num_protected_blocks: int = 0     # free blocks caching a reused prefix (evicted last)
    num_reused_blocks: int = 0        # cached blocks a later request reused (in use or free)
    num_prefix_waits: int = 0         # admissions put off for a block another request was computing
    disk: DiskTierStats | None = None  # the disk tier's figures (None: no disk tier)
    protect_window_blocks: float = 0.0  # allocations a protected block stays so unused (kvstore/fade.py; 0: never)
    num_room_waits: int = 0           # admission steps put off to keep a shared prefix (room_wait_steps)
