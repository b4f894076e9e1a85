"""Per-channel key scales for int4 KV caches, measured once on a calibration text.

A key is only ever used through q·k, so the error that quantizing it adds matters as much as
the queries that read it: an error in a channel where queries are large moves the scores,
one where they are small hardly does. Scaling key channel i by s_i and query channel i by
1/s_i leaves every q·k unchanged, but the int4 codec (`kvstore.quant`) then quantizes
`k ⊙ s`, whose error e lands on q·k as Σ (q_i / s_i) e_i. With e spread evenly over the
channels (the codec's Hadamard rotation does that) and its size following the size of
`k ⊙ s`, the expected squared error on q·k is proportional to
(Σ E[k_i²] s_i²) (Σ E[q_i²] / s_i²), which is smallest (Cauchy–Schwarz) at

    s_i = (E[q_i²] / E[k_i²]) ** (1/4)

per layer and KV head (E[q_i²] averaged over the query heads that share the KV head), for
post-RoPE q and k, then rounded to a power of two. The statistics are taken before RoPE
(second moments of each channel and of its RoPE partner, on a calibration text) and carried
through RoPE analytically for positions spread evenly over [0, N): low-frequency channel pairs
barely rotate over a context, so their post-RoPE statistics depend on how far positions
reach. N is `CALIBRATION_CONTEXT` (2048) or the model's context if shorter: in throwaway
measurements on SmolLM2, scales fitted to 512 positions helped a 512-token text most and
hurt a 2048-token one, scales fitted to 8192 helped neither, 2048 helped both.
Powers of two make the scaling exact in floating point: (q_i / s_i)(k_i s_i) is bit-for-bit
q_i k_i, so a model with scales gives the same logits as without whenever the cache is not
quantized; only what int4 loses changes. The scales are the same wherever the same weights
and calibration text meet (rounding to powers of two absorbs most dtype differences), and the
engine puts their digest into the block-hash salt anyway, so blocks quantized under other
scales are never shared.

Calibration text: 512 tokens from the middle of the Python documentation's topic texts that
ship with CPython (`pydoc_data/topics.py`), not the text `kvmesh bench accuracy` scores.
What it buys is measured by `kvmesh bench accuracy` (`int4` against `int4-unscaled`, same run).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from kvstore.layout import KVLayout
from kvstore.tensors import KVTensors
from worker.kernels.reference import AttnMetadata
from worker.model import LlamaModel

CALIBRATION_TOKENS = 512
CALIBRATION_CONTEXT = 2048  # scales are fitted to positions [0, min(this, the model's context))
MAX_LOG2_SCALE = 8  # scales stay within 2^-8 .. 2^8 (fp16 keys must not overflow)


def calibration_text() -> str:
    """Real English prose that ships with CPython: the Python docs' topic texts (pydoc)."""
    import pydoc_data
    text = (Path(pydoc_data.__file__).parent / "topics.py").read_text(encoding="utf-8")
    return text[len(text) // 2:]


def calibration_tokens(tokenizer: object | None, vocab_size: int, max_len: int) -> list[int]:
    """The first `min(CALIBRATION_TOKENS, max_len)` tokens of `calibration_text()`; without a
    tokenizer (random-weight test models), its UTF-8 bytes modulo the vocabulary."""
    n = min(CALIBRATION_TOKENS, max_len)
    text = calibration_text()[:16 * n]
    if tokenizer is not None:
        ids = list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
    else:
        ids = [b % vocab_size for b in text.encode("utf-8")]
    return ids[:n]


@torch.no_grad()
def measure_key_scales(model: LlamaModel, token_ids: list[int], num_positions: int,
                       block_size: int = 16) -> torch.Tensor:
    """Power-of-two key scales `[num_layers, num_kv_heads, head_dim]` (fp32) from one prefill of
    `token_ids` through `model` (its current scales, if any, are taken off first and left off),
    fitted to keys and queries spread evenly over positions [0, num_positions)."""
    cfg = model.cfg
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"calibration needs at least 2 tokens, got {n}")
    model.set_key_scales(None)
    # a throwaway fp32 cache: only the q/k statistics are kept (kernels upcast other dtypes)
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, "fp32")
    kv = KVTensors(layout, layout.blocks_for(n), model.device)
    meta = AttnMetadata.build([n], [n], [list(range(kv.num_blocks))], block_size, model.device)
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim)  # [L, q | k, Hkv, D]
    sq, cross = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    group = cfg.num_heads // cfg.num_kv_heads
    half = cfg.head_dim // 2

    def moments(x: torch.Tensor, heads_per_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        # x [T, H, D] before RoPE -> per KV head and channel: E[x_i^2] and E[x_i x_partner(i)]
        x = x.double()
        partner = torch.cat((x[..., half:], x[..., :half]), -1)
        return tuple(m.mean(0).view(cfg.num_kv_heads, heads_per_kv, cfg.head_dim).mean(1).cpu()
                     for m in (x * x, x * partner))

    def observe(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        (sq[layer, 0], cross[layer, 0]), (sq[layer, 1], cross[layer, 1]) = moments(q, group), moments(k, 1)

    model.observer = observe
    try:
        model.forward(torch.tensor(token_ids, device=model.device), torch.arange(n, device=model.device),
                      list(zip(kv.k_caches, kv.v_caches)), meta, torch.tensor([n - 1], device=model.device))
    finally:
        model.observer = None
    # RoPE gives channel i at position p: x_i cos_i(p) + x_partner(i) sin_signed_i(p). With the
    # content independent of the position, its mean square over p in [0, num_positions) is
    # E[x_i^2] <cos_i^2> + E[x_partner^2] <sin_i^2> + 2 E[x_i x_partner] <cos_i sin_signed_i>
    cos, sin = (t.squeeze(1).double().cpu() for t in model.rotary.tables(
        torch.arange(min(num_positions, model.rotary.cos.shape[0]), device=model.device)))
    partner_sq = torch.cat((sq[..., half:], sq[..., :half]), -1)
    post = sq * (cos ** 2).mean(0) + partner_sq * (sin ** 2).mean(0) + 2 * cross * (cos * sin).mean(0)
    q_sq, k_sq = post[:, 0], post[:, 1]
    ok = (q_sq > 0) & (k_sq > 0)
    log_s = torch.where(ok, (q_sq.clamp_min(1e-30) / k_sq.clamp_min(1e-30)).log2() / 4, 0.0)
    # only ratios between channels matter for the error; centre each head's scales on 1
    log_s = log_s - log_s.mean(-1, keepdim=True)
    return torch.exp2(log_s.round().clamp(-MAX_LOG2_SCALE, MAX_LOG2_SCALE)).float()


def scales_digest(scales: torch.Tensor) -> str:
    """A short stable hex digest of the scales (for the block-hash salt)."""
    exps = scales.log2().round().to(torch.int8).cpu().contiguous()
    return hashlib.blake2b(exps.numpy().tobytes(), digest_size=8).hexdigest()
