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

from kvstore.quant import KVCache
from worker.kernels.backend import AttentionBackend, AttentionOps, attention_ops
from worker.kernels.reference import AttnMetadata
from worker.model.config import ModelConfig
from worker.model.linear import GatedLinear, Linear
from worker.model.weights import (
    Weight,
    cat_rows,
    dense,
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
