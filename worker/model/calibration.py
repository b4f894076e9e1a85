"""Per-channel key scales and a key shift for int4 KV caches, measured once on a calibration text.

Scales. A key is only ever used through q·k, so the error that quantizing it adds matters as
much as the queries that read it: an error in a channel where queries are large moves the
scores, one where they are small hardly does. Scaling key channel i by s_i and query channel
i by 1/s_i leaves every q·k unchanged, but the int4 codec (`kvstore.quant`) then quantizes
`k ⊙ s`, whose error e lands on q·k as Σ (q_i / s_i) e_i. With e spread evenly over the
channels (the codec's Hadamard rotation does that) and its size following the size of
`k ⊙ s`, the expected squared error on q·k is proportional to
(Σ E[k_i²] s_i²) (Σ E[q_i²] / s_i²), which is smallest (Cauchy–Schwarz) at

    s_i = (E[q_i²] / E[k_i²]) ** (1/4)

per layer and KV head (E[q_i²] averaged over the query heads that share the KV head), for
post-RoPE q and k, rounded to a power of two. Powers of two make the scaling exact in
floating point: (q_i / s_i)(k_i s_i) is bit-for-bit q_i k_i, so with an unquantized cache the
logits are the same as without.

Shift. Keys share a large common part (channel pairs whose RoPE frequency is too low to
rotate much over a context keep their mean). Subtracting one vector μ from every cached key
moves all of a query's logits by the same q·μ, which the softmax ignores; int4 then covers
only the keys' spread around μ. μ is the mean scaled key.

Statistics: post-RoPE q and k of one prefill of `CALIBRATION_TOKENS` (2048) tokens, or the
model's context if shorter, skipping the first `SKIPPED_POSITIONS`. Positions matter: a
low-frequency channel's post-RoPE mean and size depend on how far positions reach. On
SmolLM2 (mean KL divergence from the fp32 cache over 2048 tokens of two texts, the accuracy
text and a held-out slice of the pydoc topics), statistics from 512 or 1024 calibration
tokens, or fitted to the keys' variance instead of E[k²], score worse; keeping the first
positions makes no difference in KL and a small one in perplexity (they are left out).
The engine puts the calibration's digest into the block-hash salt, so blocks quantized under
another calibration are never shared.

Calibration text: the middle of the Python documentation's topic texts that ship with
CPython (`pydoc_data/topics.py`), not the text `kvmesh bench accuracy` scores. What it buys is
measured by `kvmesh bench accuracy` (`int4` against `int4-uncalibrated`, same run).

Cache. The prefill costs seconds on a CPU at every int4 engine start, so
`cached_key_calibration` keeps each result in `calibration_cache_dir()`
(`cache_root()/calibration/`), keyed by everything the measurement depends on: the model's
files (config bytes; each weight file's name, size and mtime), the token ids, the dtype and
device type, torch's version and the constants above. A file that
cannot be read back (torn, foreign, wrong shapes) is measured again and replaced; a cache dir
that cannot be written only costs the next start the prefill again.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.layout import KVLayout
from kvstore.tensors import KVTensors
from worker.kernels.reference import AttnMetadata
from worker.model.llama import LlamaModel
from worker.model.loader import cache_root

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 2048  # one prefill of this many (or the model's context, if shorter)
SKIPPED_POSITIONS = 4  # the first tokens' keys (attention sinks) stay out of the statistics
MAX_LOG2_SCALE = 8  # scales stay within 2^-8 .. 2^8 (fp16 keys must not overflow)
CACHE_VERSION = 1  # bump when what is measured changes in a way the key does not see


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


@dataclass(frozen=True)
class KeyCalibration:
    """What `measure_key_calibration` fits, per layer, KV head and channel
    (`[num_layers, num_kv_heads, head_dim]` fp32 each):

    - `scales`: powers of two; post-RoPE key channels are multiplied by them, query channels
      divided (q·k unchanged bit for bit).
    - `shift`: subtracted from every scaled key before it is cached. Every key a query reads
      moves by the same vector, so all of that query's logits move by the same q·shift and the
      softmax is unchanged; what changes is what int4 sees: keys with their common offset
      removed, a smaller range to cover. Values are rounded to bf16 (any constant is exact in
      the maths; a short mantissa keeps the digest stable across devices).
    """

    scales: torch.Tensor
    shift: torch.Tensor

    def digest(self) -> str:
        """A short stable hex digest of scales and shift (for the block-hash salt)."""
        exps = self.scales.log2().round().to(torch.int8).cpu().contiguous()
        shift = self.shift.to(torch.bfloat16).view(torch.int16).cpu().contiguous()
        return hashlib.blake2b(exps.numpy().tobytes() + shift.numpy().tobytes(), digest_size=8).hexdigest()


@torch.no_grad()
def measure_key_calibration(model: LlamaModel, token_ids: list[int], block_size: int = 16) -> KeyCalibration:
    """Key scales and shift from one prefill of `token_ids` through `model` (its current
    calibration, if any, is taken off first and left off)."""
    cfg = model.cfg
    n = len(token_ids)
    if n < 2:
        raise ValueError(f"calibration needs at least 2 tokens, got {n}")
    model.set_key_scales(None)
    # a throwaway fp32 cache: only the q/k statistics are kept (kernels upcast other dtypes)
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, "fp32")
    kv = KVTensors(layout, layout.blocks_for(n), model.device)
    meta = AttnMetadata.build([n], [n], [list(range(kv.num_blocks))], block_size, model.device)
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    q_sq, k_sq, k_mean = (torch.zeros(shape, dtype=torch.float64) for _ in range(3))
    group = cfg.num_heads // cfg.num_kv_heads
    skip = min(SKIPPED_POSITIONS, n - 1)

    def observe(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        # q [T, Hq, D], k [T, Hkv, D] after RoPE: per KV head and channel over positions >= skip
        q, k = q[skip:].double(), k[skip:].double()
        q_sq[layer] = (q * q).mean(0).view(cfg.num_kv_heads, group, cfg.head_dim).mean(1).cpu()
        k_sq[layer], k_mean[layer] = (k * k).mean(0).cpu(), k.mean(0).cpu()

    model.observer = observe
    try:
        model.forward(torch.tensor(token_ids, device=model.device), torch.arange(n, device=model.device),
                      list(zip(kv.k_caches, kv.v_caches)), meta, torch.tensor([n - 1], device=model.device))
    finally:
        model.observer = None
    ok = (q_sq > 0) & (k_sq > 0)
    log_s = torch.where(ok, (q_sq.clamp_min(1e-30) / k_sq.clamp_min(1e-30)).log2() / 4, 0.0)
    # only ratios between channels matter for the error; centre each head's scales on 1
    log_s = log_s - log_s.mean(-1, keepdim=True)
    scales = torch.exp2(log_s.round().clamp(-MAX_LOG2_SCALE, MAX_LOG2_SCALE))
    shift = (k_mean * scales).to(torch.bfloat16)
    return KeyCalibration(scales.float(), shift.float())


def calibration_cache_dir() -> Path:
    return cache_root() / "calibration"


def calibration_cache_key(model: LlamaModel, model_dir: Path, token_ids: list[int], block_size: int) -> str:
    """Hex key of one calibration: what `measure_key_calibration` reads, see the module docstring."""
    h = hashlib.blake2b(digest_size=16)
    for part in (CACHE_VERSION, CALIBRATION_TOKENS, SKIPPED_POSITIONS, MAX_LOG2_SCALE, block_size,
                 model.dtype, model.device.type, torch.__version__):
        h.update(f"{part}\0".encode())
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def cached_key_calibration(model: LlamaModel, model_dir: Path, token_ids: list[int],
                           block_size: int = 16) -> KeyCalibration:
    """`measure_key_calibration`, kept on disk between engine starts (module docstring: Cache)."""
    cfg = model.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    path = calibration_cache_dir() / f"{calibration_cache_key(model, model_dir, token_ids, block_size)}.pt"
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        cal = KeyCalibration(saved["scales"], saved["shift"])
        if tuple(cal.scales.shape) == shape == tuple(cal.shift.shape) and saved["digest"] == cal.digest():
            return cal
        log.warning("calibration cache %s does not match this model; measuring again", path)
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 - any unreadable file is measured again and replaced
        log.warning("calibration cache %s unreadable (%s); measuring again", path, e)
    cal = measure_key_calibration(model, token_ids, block_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({"scales": cal.scales, "shift": cal.shift, "digest": cal.digest()}, f)
            os.chmod(tmp, 0o644)    # mkstemp's 0600 would hide it from other users of the cache
            os.replace(tmp, path)   # readers see the old file or the whole new one
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("calibration not cached at %s (%s)", path, e)
    return cal
