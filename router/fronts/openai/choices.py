"""OpenAI's `logprobs`, `top_logprobs`, `n`, `best_of` and `echo` on the HTTP front:
the request fields mapped onto SamplingParams, and the worker's responses (one sequence per
`index`, router/fronts/openai/app.py streams them) turned into OpenAI's choices, streamed or not.

Log-probabilities are the worker's (worker/engine/logprobs.py: the raw model distribution, vLLM's
default). Shapes, as OpenAI and vLLM return them:
- chat: `choices[].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token,
  logprob, bytes}]}], "refusal": null}`;
- completions: `choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`,
  `top_logprobs` entries being {token: logprob} dicts holding the top N and the chosen token;
  with `echo` the prompt's tokens come first, the first one's logprob and top dict null.
`best_of` > n ranks the sampled sequences by cumulative logprob and keeps the best n
(refused with `stream`, as OpenAI does).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contracts.sampling import MAX_LOGPROBS, MAX_N, is_int
from contracts.tokenizer import ModelTokenizer
from contracts.wire import FINISH_REASON_NAMES
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.fronts.openai.vllm_fields import FieldError

Json = dict[str, Any]
_FLOOR = -9999.0   # vLLM's stand-in for -inf, which JSON cannot carry


@dataclass(frozen=True, slots=True)
class ChoiceOptions:
    """What the client asked of the choices. `logprobs`: None, or the top alternatives per
    token (0: only the chosen token's)."""

    chat: bool
    n: int = 1
    best_of: int = 1
    logprobs: int | None = None
    echo: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.n <= self.best_of:
            raise ValueError(f"need 1 <= n={self.n} <= best_of={self.best_of}")


def choice_options(body: Json, sp: pb.SamplingParams, chat: bool) -> ChoiceOptions:
    """Validate the fields (FieldError naming the field) and set them on `sp`."""
    n = _int_field(body, "n", 1, 1, MAX_N)
    best_of = n if chat else _int_field(body, "best_of", n, n, MAX_N)
    logprobs: int | None
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise FieldError("logprobs", f"must be a boolean, got {wanted!r}")
        top = _int_field(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
        if top > 0 and not wanted:
            raise FieldError("top_logprobs", "needs logprobs: true")
        logprobs = top if wanted else None
    else:
        wanted = body.get("logprobs")    # false: none, as OpenAI's clients sometimes send it
        logprobs = None if wanted is None or wanted is False else _int_field(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = body.get("echo", False) if not chat else False
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise FieldError("echo", f"must be a boolean, got {echo!r}")
    if best_of > n and body.get("stream"):
        raise FieldError("best_of", f"best_of={best_of} > n={n} cannot be streamed")
    if n > 1:
        sp.n = n
    if best_of > n:
        sp.best_of = best_of
    if logprobs is not None:
        sp.logprobs = logprobs
    if echo:   # the prompt's logprobs come from the prefill: computed only when asked
        sp.prompt_logprobs = logprobs or 0
    return ChoiceOptions(chat, n, best_of, logprobs, echo)


def _int_field(body: Json, name: str, default: Any, low: int, high: int) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or not low <= value <= high:
        raise FieldError(name, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


@dataclass(slots=True)
class _Sequence:
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    text_offset: int = 0        # completions: chars reported so far (streaming text_offset)
    started: bool = False       # streaming: the echo / role chunk was sent


class ChoiceSet:
    """The choices of one request, fed every worker response (`add`), rendered whole
    (`render`) or as each response's streamed choice deltas (`delta`)."""

    def __init__(self, opts: ChoiceOptions, tokenizer: ModelTokenizer, prompt_ids: Sequence[int],
                 prompt_text: str | None) -> None:
        self.opts = opts
        self._tok = tokenizer
        self._prompt_ids = list(prompt_ids)
        self._prompt_text = prompt_text
        self._prompt_logprobs: list[pb.TokenLogprob] = []
        self._seqs = [_Sequence() for _ in range(opts.best_of)]
        self._strs: dict[int, str] = {}

    def add(self, r: pb.GenerateResponse) -> _Sequence:
        if not 0 <= r.index < len(self._seqs):
            raise ValueError(f"response for sequence {r.index} of {len(self._seqs)}")
        seq = self._seqs[r.index]
        seq.text.append(r.text)
        seq.logprobs.extend(r.logprobs)
        if r.prompt_logprobs:
            self._prompt_logprobs = list(r.prompt_logprobs)
        if r.sequence_finished:
            seq.finish_reason = FINISH_REASON_NAMES.get(r.finish_reason)
            seq.cumulative_logprob = r.cumulative_logprob
        return seq

    # -- whole responses -----------------------------------------------------------------
    def render(self) -> list[Json]:
        order = list(range(len(self._seqs)))
        if self.opts.best_of > self.opts.n:
            order = sorted(order, key=lambda i: -self._seqs[i].cumulative_logprob)[:self.opts.n]
        return [self._choice(index, self._seqs[i]) for index, i in enumerate(order)]

    def _choice(self, index: int, seq: _Sequence) -> Json:
        text = "".join(seq.text)
        choice: Json = {"index": index, "logprobs": None, "finish_reason": seq.finish_reason}
        if self.opts.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
            if self.opts.logprobs is not None:
                choice["logprobs"] = {"content": self._chat_logprobs(seq.logprobs), "refusal": None}
            return choice
        prefix = self._echo_text() if self.opts.echo else ""
        choice["text"] = prefix + text
        if self.opts.logprobs is not None:
            choice["logprobs"] = self._completion_logprobs(self._echo_entries() if self.opts.echo else [],
                                                           seq.logprobs, 0)
        return choice

    # -- streaming -----------------------------------------------------------------------
    def opening(self) -> list[Json]:
        """Chat: the role delta of every choice, before any content."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(self.opts.n)] if self.opts.chat else []

    def delta(self, r: pb.GenerateResponse) -> list[Json]:
        """The choice chunks for one response: its new text (with the echoed prompt first,
        once per choice) and logprobs, then its finish."""
        seq = self.add(r)
        out: list[Json] = []
        echo = self.opts.echo and not seq.started
        seq.started = True
        if r.text or r.logprobs or echo:
            if self.opts.chat:
                lp = {"content": self._chat_logprobs(r.logprobs), "refusal": None} \
                    if self.opts.logprobs is not None else None
                out.append({"index": r.index, "delta": {"content": r.text}, "logprobs": lp, "finish_reason": None})
            else:
                text = (self._echo_text() if echo else "") + r.text
                lp = None
                if self.opts.logprobs is not None:
                    lp = self._completion_logprobs(self._echo_entries() if echo else [], r.logprobs,
                                                   seq.text_offset)
                seq.text_offset += len(text)
                out.append({"index": r.index, "text": text, "logprobs": lp, "finish_reason": None})
        if r.sequence_finished:
            out.append({"index": r.index, "logprobs": None, "finish_reason": seq.finish_reason}
                       | ({"delta": {}} if self.opts.chat else {"text": ""}))
        return out

    # -- shapes --------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        s = self._strs.get(token_id)
        if s is None:
            s = self._strs[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s

    def _echo_text(self) -> str:
        if self._prompt_text is not None:
            return self._prompt_text
        return self._tok.decode(self._prompt_ids, skip_special_tokens=False)

    def _echo_entries(self) -> list[pb.TokenLogprob | int]:
        """The prompt's tokens for the completions logprobs: the first as a bare id (no logprob)."""
        return [self._prompt_ids[0], *self._prompt_logprobs] if self._prompt_ids else []

    def _chat_logprobs(self, entries: Sequence[pb.TokenLogprob]) -> list[Json]:
        def one(token_id: int, logprob: float) -> Json:
            token = self._token(token_id)
            return {"token": token, "logprob": max(logprob, _FLOOR), "bytes": list(token.encode("utf-8"))}
        return [one(e.token_id, e.logprob) | {"top_logprobs": [one(t.token_id, t.logprob) for t in e.top]}
                for e in entries]

    def _completion_logprobs(self, echo: Sequence[pb.TokenLogprob | int], entries: Sequence[pb.TokenLogprob],
                             offset: int) -> Json:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for e in [*echo, *entries]:
            token = self._token(e if isinstance(e, int) else e.token_id)
            tokens.append(token)
            text_offset.append(offset)
            offset += len(token)
            if isinstance(e, int):
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(max(e.logprob, _FLOOR))
            top = {self._token(t.token_id): max(t.logprob, _FLOOR) for t in e.top}
            top.setdefault(token, max(e.logprob, _FLOOR))   # vLLM: the chosen token is always listed
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}
