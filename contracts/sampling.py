"""Sampling parameters: validated once at the edge (router and worker alike), torch-free.

`is_int` / `is_real` are the one definition of "a JSON/proto number that is not a bool",
shared by this module and the router's HTTP front."""
from __future__ import annotations

import math
from dataclasses import dataclass

_GREEDY_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
_SEED_MIN = -(2**63)  # the range torch.Generator.manual_seed accepts
_SEED_MAX = 2**64 - 1


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
    hashable. `spaces_between_special_tokens` is accepted and carried but changes nothing yet.
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

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens <= 0:
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1")
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
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
