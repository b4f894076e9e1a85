"""The capacity plan behind `kvmesh plan` (kvmesh/plan.py renders it): how much KV cache a model
needs and how many sequences fit beside its weights.

Torch-free. Every byte figure comes from `kvstore.layout.KVLayout`, the same object the
allocator sizes its pool with, so the plan is what the pool will take.

- KV budget = gpu_memory × gpu_memory_utilization − weights (like vLLM, minus the activation
  reserve vLLM profiles at start-up, so real capacity is a little lower). Clamped at 0.
- Weights = parameter count (see `kvstore.presets`) × bytes per weight, every tensor at
  `--weights-dtype`. GGUF formats at the size kvmesh's CPU engine holds them, scales included
  (q8_0: 8.5 bits a weight; q4_0 and q4_1: 5 bits, see worker/model/weights.py); int8 / int4
  count no scales. `extra_blocks_vs_fp32`: the KV blocks the bytes these weights leave over
  fp32 weights hold (what a Q4 model gains), shown with or without --gpu-memory.
- `--kv-cache-dtype auto` stores KV in the compute dtype: fp32/bf16 weights compute in their
  own dtype, fp16/int8/int4 weights in fp16, the GGUF formats in fp32 (the CPU engine).
- Paged figures hold whole blocks. `max_sequences` = whole blocks in the budget // blocks per
  sequence of `--context` tokens. Headline figures assume full attention in every layer;
  `sliding_window` shows the per-sequence cap a windowed model allows.
- `--lengths` is the workload for the waste report: `a,b,c` (token counts ≤ --context),
  `uniform:N` (N lengths ceil(context·i/N), i = 1…N — the default is uniform:64), or
  `zipf:N[:S]` (rank-size: round(context / i^S), i = 1…N, S defaults to 1). Contiguous
  allocation reserves --context tokens per sequence; paged allocation whole blocks.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.layout import KV_CACHE_DTYPES, KVLayout, resolve_kv_cache_dtype
from kvstore.presets import PRESETS, ModelShape, PlanError, load_model_shape

__all__ = ["PlanError", "PlanConfig", "Plan", "ModelShape", "PRESETS", "load_model_shape",
           "parse_lengths", "make_plan", "format_bytes", "GIB", "KV_CACHE_DTYPES", "WEIGHTS_DTYPES", "DEFAULT_LENGTHS"]

GIB = 1 << 30
WEIGHTS_DTYPES = ("fp32", "fp16", "bf16", "int8", "int4", "q8_0", "q4_0", "q4_1")
PER_DTYPES = ("fp16", "fp8", "int8", "int4")
DEFAULT_LENGTHS = "uniform:64"
MAX_LENGTHS = 100_000
# bits per weight, x2 (whole numbers): q8_0 = 8.5 bits, q4_* = 5 bits as the CPU engine holds them
_WEIGHT_HALF_BITS = {"fp32": 64, "fp16": 32, "bf16": 32, "int8": 16, "int4": 8, "q8_0": 17, "q4_0": 10, "q4_1": 10}
_COMPUTE_DTYPE = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "int8": "fp16", "int4": "fp16",
                  "q8_0": "fp32", "q4_0": "fp32", "q4_1": "fp32"}


def format_bytes(num: float) -> str:
    """`num` bytes in the largest of GiB / MiB / KiB that fits, two decimals (`1.50 GiB`); bytes below 1 KiB."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(num) >= size:
            return f"{num / size:.2f} {unit}"
    return f"{num:.0f} B"


_LENGTHS_ACCEPTED = ("accepted: comma-separated positive token counts <= --context, "
                     "'uniform:N' or 'zipf:N[:S]'")


def _positive_int(flag: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(flag, value, "must be a positive integer")


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """What to plan for. Field names match the CLI flags (`gpu_memory_gib` is --gpu-memory)."""

    context: int = 4096
    batch: int = 1
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    gpu_memory_gib: float | None = None
    weights_dtype: str = "fp16"
    gpu_memory_utilization: float = 0.9
    lengths: str | tuple[int, ...] = DEFAULT_LENGTHS

    def __post_init__(self) -> None:
        _positive_int("--context", self.context)
        _positive_int("--batch", self.batch)
        _positive_int("--block-size", self.block_size)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise PlanError("--kv-cache-dtype", self.kv_cache_dtype,
                            f"accepted: {', '.join(KV_CACHE_DTYPES)}")
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise PlanError("--weights-dtype", self.weights_dtype,
                            f"accepted: {', '.join(WEIGHTS_DTYPES)}")
        gpu = self.gpu_memory_gib
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, (int, float))
                                or not math.isfinite(gpu) or gpu <= 0):
            raise PlanError("--gpu-memory", gpu, "must be a positive number of GiB")
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise PlanError("--gpu-memory-utilization", util, "must be in (0, 1]")
        parse_lengths(self.lengths, self.context)


def parse_lengths(spec: str | Sequence[int], context: int) -> tuple[int, ...]:
    """The sequence lengths of a `--lengths` spec (see the module docstring); deterministic."""
    if not isinstance(spec, str):
        values = tuple(spec)
        if not values or len(values) > MAX_LENGTHS or any(
                isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= context
                for n in values):
            raise PlanError("--lengths", spec, _LENGTHS_ACCEPTED)
        return values
    kind, _, rest = spec.strip().partition(":")
    try:
        if kind in ("uniform", "zipf"):
            parts = rest.split(":")
            count = int(parts[0])
            exponent = float(parts[1]) if kind == "zipf" and len(parts) == 2 else 1.0
            if not 0 < count <= MAX_LENGTHS or len(parts) > (2 if kind == "zipf" else 1) \
                    or not 0 < exponent < math.inf:
                raise ValueError(spec)
            if kind == "uniform":
                return tuple(-(-context * i // count) for i in range(1, count + 1))
            return tuple(max(1, round(context / i ** exponent)) for i in range(1, count + 1))
        return parse_lengths([int(part) for part in spec.split(",")], context)
    except ValueError:
        raise PlanError("--lengths", spec, _LENGTHS_ACCEPTED) from None


@dataclass(frozen=True, slots=True)
class AttentionVariant:
    """The same model with `num_key_value_heads` kv heads: MHA (= heads), its GQA, MQA (1)."""

    name: str
    num_key_value_heads: int
    bytes_per_token: int
    bytes_per_sequence: int
    max_sequences: int | None
    is_model: bool


@dataclass(frozen=True, slots=True)
class DtypeRow:
    """The model's KV in one storage dtype; quantized rows include scale (+zero) bytes."""

    kv_cache_dtype: str
    bytes_per_token: int
    bytes_per_sequence: int
    max_sequences: int | None


@dataclass(frozen=True, slots=True)
class SlidingWindowPlan:
    """Per-sequence KV with the window cap: window tokens + 1 block (the window straddles one)."""

    window: int
    blocks_per_sequence_capped: int
    bytes_per_sequence_capped: int
    bytes_per_sequence_uncapped: int
    max_sequences_capped: int | None
    max_sequences_uncapped: int | None


@dataclass(frozen=True, slots=True)
class WastePlan:
    """Unused-but-allocated token slots for a length distribution, paged vs contiguous."""

    lengths: str
    num_lengths: int
    mean_length: float
    max_length: int
    paged_waste_fraction: float
    contiguous_waste_fraction: float
    paged_sequences_admitted: int | None  # sequences drawn in proportion to the lengths
    contiguous_sequences_admitted: int | None  # each reserves max_length tokens


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything `kvmesh plan` reports. Byte counts are exact integers."""

    model: ModelShape
    config: PlanConfig
    kv_cache_dtype: str  # resolved, never "auto"
    num_params: int
    weights_bytes: int
    bytes_per_token: int
    bytes_per_block: int
    blocks_per_sequence: int
    bytes_per_sequence: int
    bytes_total: int
    usable_bytes: int | None  # gpu_memory × utilization; None without --gpu-memory
    kv_budget_bytes: int | None
    num_blocks: int | None  # whole blocks in the KV budget
    max_sequences: int | None
    fits: bool | None  # batch sequences of context tokens fit in the budget; None: unknown
    attention_variants: tuple[AttentionVariant, ...]
    sliding_window: SlidingWindowPlan | None
    waste: WastePlan
    per_dtype: tuple[DtypeRow, ...]
    warnings: tuple[str, ...]
    extra_blocks_vs_fp32: int = 0  # KV blocks (this layout) in the bytes the weights save over fp32

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def _max_sequences(layout: KVLayout, tokens: int, budget: int | None) -> int | None:
    return None if budget is None else layout.num_blocks_in(budget) // layout.blocks_for(tokens)


def _waste(layout: KVLayout, cfg: PlanConfig, budget: int | None) -> WastePlan:
    lengths = parse_lengths(cfg.lengths, cfg.context)
    used = sum(lengths)
    blocks = sum(layout.blocks_for(n) for n in lengths)
    paged_slots, contiguous_slots = blocks * layout.block_size, len(lengths) * cfg.context
    paged_admitted = contiguous_admitted = None
    if budget is not None:
        paged_admitted = layout.num_blocks_in(budget) * len(lengths) // blocks
        contiguous_admitted = budget // layout.bytes_per_sequence(cfg.context, paged=False)
    spec = cfg.lengths if isinstance(cfg.lengths, str) else ",".join(map(str, cfg.lengths))
    return WastePlan(spec, len(lengths), used / len(lengths), cfg.context,
                     (paged_slots - used) / paged_slots,
                     (contiguous_slots - used) / contiguous_slots,
                     paged_admitted, contiguous_admitted)


def make_plan(shape: ModelShape, *, context: int = 4096, batch: int = 1,
              kv_cache_dtype: str = "auto", block_size: int = 16,
              gpu_memory_gib: float | None = None, weights_dtype: str = "fp16",
              gpu_memory_utilization: float = 0.9,
              lengths: str | Sequence[int] | None = None) -> Plan:
    """Plan the KV cache of `shape`. Raises PlanError (naming the flag) on bad input."""
    if lengths is None:
        lengths = DEFAULT_LENGTHS
    cfg = PlanConfig(context, batch, kv_cache_dtype, block_size, gpu_memory_gib, weights_dtype,
                     gpu_memory_utilization, lengths if isinstance(lengths, str) else tuple(lengths))
    kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, _COMPUTE_DTYPE[cfg.weights_dtype])
    warnings: list[str] = []

    def layout_for(dtype: str, kv_heads: int = shape.num_key_value_heads) -> KVLayout:
        return KVLayout(shape.num_hidden_layers, kv_heads, shape.head_dim, cfg.block_size, dtype)

    try:
        layout = layout_for(kv_dtype)
    except ValueError as exc:
        raise PlanError("--kv-cache-dtype", cfg.kv_cache_dtype, str(exc)) from None
    num_params = shape.num_params
    weights_bytes = -(-num_params * _WEIGHT_HALF_BITS[cfg.weights_dtype] // 16)
    extra_blocks = layout.num_blocks_in(max(0, num_params * 4 - weights_bytes))
    usable = budget = None
    if cfg.gpu_memory_gib is not None:
        usable = round(cfg.gpu_memory_gib * GIB * cfg.gpu_memory_utilization)
        budget = max(0, usable - weights_bytes)
        if weights_bytes > usable:
            warnings.append(f"weights ({format_bytes(weights_bytes)}) exceed usable GPU memory "
                            f"({format_bytes(usable)}): no room for any KV cache")
    max_pos = shape.max_position_embeddings
    if max_pos is not None and cfg.context > max_pos:
        warnings.append(f"--context {cfg.context} exceeds the model's max_position_embeddings "
                        f"{max_pos}")
    max_sequences = _max_sequences(layout, cfg.context, budget)

    variants = []
    heads, kv_heads = shape.num_attention_heads, shape.num_key_value_heads
    for name, n in (("mha", heads), ("gqa", kv_heads), ("mqa", 1)):
        if name == "gqa" and not 1 < n < heads:
            continue
        var = layout_for(kv_dtype, n)
        variants.append(AttentionVariant(name, n, var.bytes_per_token,
                                         var.bytes_per_sequence(cfg.context),
                                         _max_sequences(var, cfg.context, budget), n == kv_heads))

    per_dtype = []
    for dtype in PER_DTYPES:
        try:
            var = layout_for(dtype)
        except ValueError as exc:
            warnings.append(f"{dtype} KV left out of per_dtype: {exc}")
            continue
        per_dtype.append(DtypeRow(dtype, var.bytes_per_token, var.bytes_per_sequence(cfg.context),
                                  _max_sequences(var, cfg.context, budget)))

    window = None
    if shape.sliding_window is not None:
        capped = min(layout.blocks_for(cfg.context), layout.blocks_for(shape.sliding_window) + 1)
        capped_bytes = capped * layout.bytes_per_block
        window = SlidingWindowPlan(
            shape.sliding_window, capped, capped_bytes, layout.bytes_per_sequence(cfg.context),
            None if budget is None else layout.num_blocks_in(budget) // capped, max_sequences)

    return Plan(
        model=shape, config=cfg, kv_cache_dtype=kv_dtype, num_params=num_params,
        weights_bytes=weights_bytes, bytes_per_token=layout.bytes_per_token,
        bytes_per_block=layout.bytes_per_block,
        blocks_per_sequence=layout.blocks_for(cfg.context),
        bytes_per_sequence=layout.bytes_per_sequence(cfg.context),
        bytes_total=layout.bytes_for_batch(cfg.context, cfg.batch),
        usable_bytes=usable, kv_budget_bytes=budget,
        num_blocks=None if budget is None else layout.num_blocks_in(budget),
        max_sequences=max_sequences,
        fits=None if max_sequences is None else cfg.batch <= max_sequences,
        attention_variants=tuple(variants), sliding_window=window,
        waste=_waste(layout, cfg, budget), per_dtype=tuple(per_dtype), warnings=tuple(warnings),
        extra_blocks_vs_fp32=extra_blocks)
