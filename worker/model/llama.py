"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) written for a paged KV cache.

The model sees a flat batch of new tokens ([T]) with their absolute positions and an
`AttnMetadata` describing which sequence each token belongs to; K/V are written into the
paged cache and attention reads them back through block tables. It never sees a request.

Weights use the HF tensor names; q/k/v and gate/up are fused at load time (one matmul each)
because on CPU the per-op overhead of a 135M model is a large share of a decode step.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from kvstore.quant import KVCache
from worker.kernels import native
from worker.kernels.backend import AttentionBackend, AttentionOps, attention_ops
from worker.kernels.reference import AttnMetadata
from worker.model.config import ModelConfig
from worker.model.weights import (
    BLOCK,
    PANEL,
    Bf16Weight,
    PackedWeight,
    QuantRows,
    Weight,
    WeightFormat,
    cat_rows,
    dense,
    format_of,
    pack,
    take_rows,
    weight_shape,
)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], with Llama-3 / linear scaling from the config."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling
    if rs is None or rs.rope_type == "default":
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    if rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling.rope_type={rs.rope_type!r} is not supported (default, linear, llama3)")


class Rotary:
    """cos/sin tables for every position up to max_position_embeddings, built once.

    `tables(positions)` looks the rows up once per forward pass; `apply` then rotates q and k
    of every layer with four ops. `sin_signed` is sin with its first half negated, so
    `(x2, x1) * sin_signed` is exactly HF's `rotate_half(x) * sin` (a product with a
    negated factor equals the negated product in IEEE arithmetic), and the sum is formed in
    HF's order, so the result is bit-identical.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        inv_freq = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)                       # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                  # [P, D]
        self.cos = emb.cos().to(dtype=dtype, device=device)      # [P, D]
        self.sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)  # [P, D]

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_signed) rows of `positions` [T], each [T, 1, D]."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D] (any strides); cos, sin_signed: [T, 1, D]
        half = x.shape[-1] // 2
        flipped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)     # [T, H, D]: (x2, x1)
        return x * cos + flipped * sin_signed

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D]; positions: [T]
        return self.apply(x, *self.tables(positions))


def pack_huge(w: Weight, fmt: WeightFormat) -> PackedWeight:
    """`pack` into huge-page memory (the kernel streams it every step)."""
    n, k = weight_shape(w)
    return pack(w, fmt, native.empty_huge_bytes(-(-n // PANEL) * (k // BLOCK) * fmt.record_bytes))


class Linear:
    """y = x Wᵀ + b, with the kernel that is fastest on CPU for the number of rows.

    fp32 on CPU with the native kernels built: up to MAX_PACKED_M rows (decode) run
    `native.packed_linear` over a copy of W packed once here, which streams the weights near the
    machine's read bandwidth and reads them once for all rows (see csrc/linear.cpp); more rows
    (prefill) run F.linear, the GEMM library at its matmul peak, with the residual add inside
    the GEMM (addmm) and the input norm in one native pass. Without the native kernels
    (`KVMESH_NATIVE_KERNELS=0`, no compiler, no AVX2) the torch shapes measured on a 2-core
    x86 CPU: one row against a contiguous Wᵀ [in, out] (~35% faster than F.linear), 2..32 rows
    as W · xᵀ (20-60% faster), wider batches F.linear. On GPU it is always F.linear and no
    copy of W is kept.
    """

    MAX_SMALL_M = 32
    MAX_PACKED_M = 32

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None,
                 packed_rows: torch.Tensor | None = None, matmul: bool = True) -> None:
        """`weight`: a dense tensor, or quantized / bf16-stored rows (worker.model.weights), which
        on a CPU with the kernel are packed in their own format and run by `native.qlinear` for
        every row count (no fp32 copy is kept), else dequantized here. `packed_rows`: the order of
        W's rows in the packed copy (GatedLinear's interleaving; then only the caller that knows
        the order runs the packed kernel). `matmul=False`: only `rows` is used (an untied
        embedding): a dense weight gets no packed copy."""
        self.qweight: PackedWeight | None = None
        if isinstance(weight, (QuantRows, Bf16Weight)):
            fmt = format_of(weight)
            if native.qlinear_isa() and weight_shape(weight)[1] % BLOCK == 0:
                rows = weight if packed_rows is None else take_rows(weight, packed_rows)
                self.qweight = pack_huge(rows, fmt)
                weight = torch.empty(0, weight_shape(weight)[1])
            else:
                weight = dense(weight)
        self.weight = weight.contiguous()                         # [out, in] ([0, in]: packed in its format)
        self.bias = bias
        self.out_features = self.qweight.n if self.qweight is not None else weight.shape[0]
        self.cpu = weight.device.type == "cpu"
        supported = matmul and self.qweight is None and native.linear_supported(self.weight) \
            and (bias is None or bias.dtype == torch.float32)
        self.packed = native.pack_linear(self.weight if packed_rows is None else self.weight[packed_rows]) \
            if supported else None                                # [ceil(out / 16), in, 16]
        self.packed_in_order = (self.packed is not None or self.qweight is not None) and packed_rows is None
        self.weight_t = self.weight.t().contiguous() if matmul and self.cpu and self.packed is None \
            and self.qweight is None else None                    # [in, out]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] [T, in] (the embedding lookup), dequantized when W is packed in its own format."""
        if self.qweight is not None:
            return native.qrows(self.qweight.data, self.qweight.fmt.kernel_code, self.qweight.n, ids)
        return F.embedding(ids, self.weight)

    def _q(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
           eps: float = 1e-6, gated: bool = False) -> torch.Tensor:
        q = self.qweight
        assert q is not None
        return native.qlinear(x, q.data, q.fmt.kernel_code, q.n, self.bias, residual, norm_weight, eps, gated)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self.qweight is not None and self.packed_in_order:
            return self._q(x)
        if self.packed is not None and self.packed_in_order and m <= self.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.out_features, self.bias)
        if self.weight_t is None or m > self.MAX_SMALL_M:
            return F.linear(x, self.weight, self.bias)
        if m == 1:
            y = x @ self.weight_t                                 # [1, out]
        else:
            y = self._w_xt(x).t().contiguous()                    # [M, out]
        return y + self.bias if self.bias is not None else y

    @staticmethod
    def gemm_rows(m: int) -> int:
        """How many rows the W · xᵀ GEMM runs for m rows (2..MAX_SMALL_M) on the torch path.

        The GEMM's time is not monotone in its row count. Measured over SmolLM2's 121 decode
        GEMMs (same CPU): 15 rows take ~1.8x as long as 16, 23 ~1.6x as long as 24, 12 ~1.1x;
        counts of 8k, 8k + 1 and 8k + 2 rows run about as fast as their neighbours below. So
        other counts from 7 up round up to a multiple of 8 (zero rows, sliced off), and 3 -> 4.
        """
        if m <= 6:
            return 4 if m == 3 else m
        return m if m % 8 <= 2 else -(-m // 8) * 8

    def _w_xt(self, x: torch.Tensor) -> torch.Tensor:
        """W · xᵀ [out, M], run on `gemm_rows(M)` rows (zero rows appended, then sliced off)."""
        m = x.shape[0]
        rows = self.gemm_rows(m)
        if rows != m:
            x = F.pad(x, (0, 0, 0, rows - m))
        y = torch.mm(self.weight, x.t())                          # [out, rows]
        return y if rows == m else y[:, :m]

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps)); the packed kernel normalises x itself (one call
        instead of the norm's ops: at batch 1 each op costs as much as a small GEMV)."""
        if self.qweight is not None and self.packed_in_order:
            return self._q(x, norm_weight=norm_weight, eps=eps)
        if self.packed is not None and self.packed_in_order and x.shape[0] <= self.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.out_features, self.bias, norm_weight=norm_weight, eps=eps)
        if self.packed is not None:  # a long prefill: the norm in one native pass, then the GEMM
            return self(native.rms_norm(x, norm_weight, eps))
        return self(rms_norm(x, norm_weight, eps))

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + (x Wᵀ + b); the packed kernel adds in its epilogue, and on the W · xᵀ path
        the add reads the transposed product directly instead of copying it back first."""
        m = x.shape[0]
        if self.qweight is not None and self.packed_in_order:
            return self._q(x, residual)
        if self.packed is not None and self.packed_in_order and m <= self.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.out_features, self.bias, residual)
        if self.packed is not None and self.bias is None:  # a long prefill: the add inside the GEMM
            return torch.addmm(residual, x, self.weight.t())
        if self.weight_t is None or not 1 < m <= self.MAX_SMALL_M:
            return residual + self(x)
        y = self._w_xt(x)                                         # [out, M]
        if self.bias is not None:
            y = y + self.bias[:, None]
        return residual + y.t()                                   # [M, out], contiguous like residual


class GatedLinear:
    """silu(x W_gateᵀ) * (x W_upᵀ), [M, I]: the MLP's gate and up projections as one weight.

    For the packed kernel the rows are packed interleaved, 8 gate rows then the 8 up rows of the
    same channels, so each 16-row panel yields 8 finished outputs and the kernel applies
    silu(gate) * up in its epilogue; otherwise one GEMM over [gate; up], then chunk, silu, mul.
    """

    GROUP = 8

    def __init__(self, gate: Weight, up: Weight) -> None:
        assert weight_shape(gate) == weight_shape(up), (weight_shape(gate), weight_shape(up))
        i = weight_shape(gate)[0]
        # packed rows g0..g7, u0..u7, g8..g15, u8..u15, ...: [2, I / 8, 8] -> [I / 8, 2, 8]
        order = torch.arange(2 * i).view(2, i // self.GROUP, self.GROUP).transpose(0, 1).flatten() \
            if i % self.GROUP == 0 else None
        self.proj = Linear(cat_rows([gate, up]), packed_rows=order)   # [2 I, in]
        self.packed = self.proj.packed if order is not None else None   # interleaved rows
        self.qgated = self.proj.qweight is not None and order is not None
        self.gated_kernel = self.packed is not None or self.qgated

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.qgated:
            return self.proj._q(x, gated=True)
        if self.packed is not None and x.shape[0] <= Linear.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.proj.out_features, gated=True)
        if self.proj.packed is not None:  # a long prefill: silu(gate) * up in one native pass
            return native.silu_mul(self.proj(x))
        gate, up = self.proj(x).chunk(2, dim=-1)
        return F.silu(gate) * up

    def normed(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rms_norm(x, norm_weight, eps)), in one kernel call on the packed path."""
        if self.qgated:
            return self.proj._q(x, norm_weight=norm_weight, eps=eps, gated=True)
        if self.packed is not None and x.shape[0] <= Linear.MAX_PACKED_M:
            return native.packed_linear(x, self.packed, self.proj.out_features, norm_weight=norm_weight,
                                        eps=eps, gated=True)
        if self.proj.packed is not None:
            return self(native.rms_norm(x, norm_weight, eps))
        return self(rms_norm(x, norm_weight, eps))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as HF's LlamaRMSNorm (variance in fp32, then cast back) so outputs match.
    dtype = x.dtype
    if dtype == torch.float32:
        if x.shape[0] <= Linear.MAX_SMALL_M:  # one op, bit-identical in fp32; slower on long prefills
            return torch.rms_norm(x, (x.shape[-1],), weight, eps)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: Mapping[str, Weight], prefix: str, attention: AttentionOps) -> None:
        self.cfg = cfg
        self.attention = attention  # the backend's write_kv / paged_attention (worker.kernels.backend)
        attn = prefix + "self_attn."
        self.qkv_proj = Linear(
            cat_rows([w[attn + "q_proj.weight"], w[attn + "k_proj.weight"], w[attn + "v_proj.weight"]]),
            torch.cat([w[attn + "q_proj.bias"], w[attn + "k_proj.bias"], w[attn + "v_proj.bias"]])
            if cfg.attention_bias else None)
        self.o_proj = Linear(w[attn + "o_proj.weight"])
        mlp = prefix + "mlp."
        self.gate_up_proj = GatedLinear(w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"])
        self.down_proj = Linear(w[mlp + "down_proj.weight"])
        self.ln1 = dense(w[prefix + "input_layernorm.weight"], self.qkv_proj.weight.dtype)
        self.ln2 = dense(w[prefix + "post_attention_layernorm.weight"], self.qkv_proj.weight.dtype)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # [Hq + Hkv, D] post-RoPE factors: 1/s on query channels, s on key channels (see
        # worker.model.calibration); None = no scaling
        self.qk_scale: torch.Tensor | None = None
        # [Hkv, D] subtracted from every (scaled) key before it is cached; None = no shift
        self.k_shift: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 k_cache: KVCache, v_cache: KVCache, meta: AttnMetadata,
                 keep: torch.Tensor | None = None,
                 observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
        """One layer on T tokens; `rope` is `Rotary.tables(positions)`, shared by all layers.

        With `keep` ([n] row indices) only those rows leave the layer (`[n, hidden]`): every
        row's K/V is still written, but o_proj and the MLP run on the kept rows alone.
        `observe(q, k)` sees the queries and keys after RoPE, before any key scaling (calibration).
        """
        cfg = self.cfg
        qkv = self.qkv_proj.normed(x, self.ln1, cfg.rms_norm_eps)  # [T, q + 2 kv]
        o = None
        fused = self.attention.rope_decode
        if fused is not None and observe is None and self.qk_scale is None and self.k_shift is None:
            o = fused(qkv, rope, k_cache, v_cache, meta, self.scale, cfg.sliding_window, cfg.num_heads)  # [T, q]
        if o is None:
            o = self._attend(qkv, rope, k_cache, v_cache, meta, observe)
        if keep is not None:
            x, o = x[keep], o[keep]
        x = self.o_proj.add_to(x, o)
        return self.down_proj.add_to(x, self.gate_up_proj.normed(x, self.ln2, cfg.rms_norm_eps))

    def _attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_cache: KVCache,
                v_cache: KVCache, meta: AttnMetadata,
                observe: Callable[[torch.Tensor, torch.Tensor], None] | None) -> torch.Tensor:
        """RoPE, key scaling, write_kv and paged attention of qkv [T, q + 2 kv] -> [T, q]: the
        steps the backend's `rope_decode` runs as one kernel where it applies."""
        cfg = self.cfg
        t = qkv.shape[0]
        # q and k are adjacent in each row: rotate them as one [T, Hq + Hkv, D] view
        qk = Rotary.apply(qkv[:, :self.q_size + self.kv_size].view(t, -1, cfg.head_dim), *rope)
        if observe is not None:
            observe(qk[:, :cfg.num_heads], qk[:, cfg.num_heads:])
        if self.qk_scale is not None:
            qk.mul_(self.qk_scale)                                 # exact: powers of two
        q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]        # [T, Hq, D], [T, Hkv, D]
        if self.k_shift is not None:
            k = k - self.k_shift                                   # softmax-invariant (see set_key_scales)
        v = qkv[:, self.q_size + self.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        self.attention.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attention.paged_attention(q, k_cache, v_cache, meta, self.scale,
                                              cfg.sliding_window).reshape(t, self.q_size)


class LlamaModel:
    """The decoder stack plus the LM head. Construct from HF-named weights (see worker.model.loader)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, Weight],
                 attention: AttentionOps | None = None) -> None:
        """`weights`: dense tensors of one dtype, or (linear weights and the embedding) rows in
        their own format, see worker.model.weights. `attention`: the kernels every layer runs
        (default: the native backend's, which falls back to the torch reference wherever the
        native kernel does not apply)."""
        self.cfg = cfg
        embed = weights["model.embed_tokens.weight"]
        self.lm_head = Linear(embed if cfg.tie_word_embeddings else weights["lm_head.weight"])
        self.embedding = self.lm_head if cfg.tie_word_embeddings else Linear(embed, matmul=False)
        self.dtype = self.lm_head.weight.dtype                   # the activations' dtype
        self.device = self.lm_head.weight.device
        self.attention = attention or attention_ops(AttentionBackend.NATIVE)
        self.layers = [DecoderLayer(cfg, weights, f"model.layers.{i}.", self.attention)
                       for i in range(cfg.num_layers)]
        self.norm = dense(weights["model.norm.weight"], self.dtype)
        self.rotary = Rotary(cfg, self.dtype, self.device)
        self.observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        self.key_scales: torch.Tensor | None = None
        self.key_shift: torch.Tensor | None = None

    def set_key_scales(self, scales: torch.Tensor | None, shift: torch.Tensor | None = None) -> None:
        """Scale post-RoPE key channels by `scales` [num_layers, num_kv_heads, head_dim] (powers
        of two) and query channels by their inverses, so every q·k is unchanged (bit for bit)
        while the cached keys are `k ⊙ s`; then subtract `shift` (same shape) from every key
        before it is cached: each query's logits all move by the same q·shift, so attention is
        unchanged up to rounding. None removes both. See worker.model.calibration."""
        cfg = self.cfg
        shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        if scales is not None:
            assert scales.shape == shape, scales.shape
            assert torch.equal(scales, torch.exp2(scales.log2().round())), "scales must be powers of two"
        assert shift is None or (scales is not None and shift.shape == shape), "a shift needs scales"
        self.key_scales, self.key_shift = scales, shift
        group = cfg.num_heads // cfg.num_kv_heads
        for i, layer in enumerate(self.layers):
            layer.qk_scale = None if scales is None else torch.cat(
                (1.0 / scales[i].repeat_interleave(group, 0), scales[i])).to(self.device, self.dtype)
            layer.k_shift = None if shift is None else shift[i].to(self.device, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[tuple[KVCache, KVCache]], meta: AttnMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Run T new tokens; returns fp32 logits [len(logits_indices) or T, vocab].

        input_ids, positions: [T]. kv_caches[i] = (k_cache, v_cache) of layer i, each
        [num_blocks, block_size, num_kv_heads, head_dim]; written in place at meta.slot_mapping.
        """
        assert input_ids.dim() == 1 and input_ids.shape == positions.shape
        assert len(kv_caches) == len(self.layers)
        x = self.embedding.rows(input_ids)                        # [T, hidden]
        rope = self.rotary.tables(positions)
        # the last layer's o_proj and MLP only matter for the rows whose logits are returned
        # (a prefill samples one row per sequence); decode keeps every row, so skip the gather
        keep = logits_indices if logits_indices is not None and len(logits_indices) < len(input_ids) else None
        last = len(self.layers) - 1
        obs = self.observer
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope, k_cache, v_cache, meta, keep if i == last else None,
                      None if obs is None else functools.partial(obs, i))
        if logits_indices is not None and keep is None:
            x = x[logits_indices]
        return self.lm_head.normed(x, self.norm, self.cfg.rms_norm_eps).float()
