"""Sampling parameters: validated once at the edge (router and worker alike), torch-free.

`is_int` / `is_real` are the one definition of "a JSON/proto number that is not a bool",
shared by this module and the router's HTTP front."""
from __future__ import annotations

import math
from dataclasses import dataclass

_GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
_SEED_MIN = -(2**63)  # the range torch.Generator.manual_seed accepts
_SEED_MAX = 2**64 - 1
MAX_LOGPROBS = 20   # top alternatives per token, as OpenAI caps top_logprobs
MAX_N = 16          # sequences per request (n, best_of): one request cannot take the whole pool


class SamplingParamsError(ValueError):
    """A SamplingParams field is out of range; the message names the field and the range."""


def _bad(field: str, value: object, accepted: str) -> SamplingParamsError:
    return SamplingParamsError(f"{field} must be {accepted}, got {value!r}")


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """An int or float that is not a bool (may be NaN or infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, spelled as in vLLM / the OpenAI API.

    `top_k` of 0 or -1 disables top-k. Before `min_tokens` output tokens, EOS and
    `stop_token_ids` cannot be sampled and stop strings are not checked (vLLM's meaning).
    `truncate_prompt_tokens` keeps only the last N prompt tokens. `stop` and `stop_token_ids`
    accept lists (or a single stop string) and are stored as tuples so the object stays
    hashable. `spaces_between_special_tokens` puts a space between adjacent special tokens
    when they are not skipped (vLLM).
    `logprobs` (0..MAX_LOGPROBS; None: none): each output token's log-probability plus that
    many top alternatives, of the raw model distribution (vLLM's default `raw_logprobs`:
    before penalties, temperature and the top-k/p filters). `prompt_logprobs`: the same for
    every prompt token after the first; such requests compute their whole prompt (no prefix
    cache hit) and may have `max_tokens` 0 (the prompt only). `n` sequences are returned,
    sampled from `best_of` (default n) forked after the prefill; the n with the highest
    cumulative log-probability are kept.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    min_tokens: int = 0
    truncate_prompt_tokens: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise _bad(name, value, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if not is_int(self.max_tokens) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise _bad("max_tokens", self.max_tokens,
                       "an integer >= 1 (0 only with prompt_logprobs, e.g. echo)")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise _bad("n", self.n, f"an integer in [1, {MAX_N}]")
        if self.best_of is not None and (not is_int(self.best_of) or not self.n <= self.best_of <= MAX_N):
            raise _bad("best_of", self.best_of, f"None or an integer in [n={self.n}, {MAX_N}]")
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:  # NaN fails the comparison
            raise _bad("top_p", self.top_p, "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "0 or -1 (disabled) or an integer >= 1")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not _SEED_MIN <= self.seed <= _SEED_MAX):
            raise _bad("seed", self.seed, f"None or an integer in [{_SEED_MIN}, {_SEED_MAX}]")
        rp = self.repetition_penalty
        if not is_real(rp) or not math.isfinite(rp) or rp <= 0:
            raise _bad("repetition_penalty", rp, "a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2.0 <= value <= 2.0:
                raise _bad(name, value, "in [-2, 2]")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", self.stop, "a sequence of non-empty strings")
        object.__setattr__(self, "stop", stop)
        stop_ids = tuple(self.stop_token_ids)
        for t in stop_ids:
            if not is_int(t) or t < 0:
                raise _bad("stop_token_ids", self.stop_token_ids, "a sequence of integers >= 0")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        tpt = self.truncate_prompt_tokens
        if tpt is not None and (not is_int(tpt) or tpt < 1):
            raise _bad("truncate_prompt_tokens", tpt, "None or an integer >= 1")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a boolean")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def num_sequences(self) -> int:
        """How many sequences are sampled (best_of, else n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def wants_logprobs(self) -> bool:
        """Whether the sampled tokens' log-probabilities are computed: asked for, or needed
        to rank best_of > n sequences."""
        return self.logprobs is not None or self.num_sequences > self.n

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
