"""Bounded work before the checks: how much a request may make the router read and tokenize,
derived from the model instead of a fixed figure.

- **Bytes per token.** `max_token_bytes(tok)`: the most UTF-8 bytes one token of the
  tokenizer stands for (the longest single-token decode, +1 for a decoder that strips a leading
  space). Computed once per tokenizer (a pass over the vocabulary in a thread, ~0.3 s for
  49k tokens). For a byte-level BPE tokenizer (the Llama family) n tokens cover at most
  n x that many bytes, so a prompt of more characters than `max_model_len x max_token_bytes`
  cannot fit the context whatever it says.
- **Prompt characters.** `check_prompt_chars` refuses (BadRequest: HTTP 400 /
  INVALID_ARGUMENT) a text or chat prompt over that bound before a token is computed.
- **HTTP body.** `body_limit` = `max_model_len x max_token_bytes x 6` (the worst JSON
  escape, `\\u0001` for one byte) + 64 KiB for the other fields, capped by the router's
  `max_message_bytes`; the HTTP guard (router/fronts/openai/guard.py) refuses a longer body
  (413) before reading it.
- **Memory after a refusal.** A refused prompt of over `TRIM_AFTER_CHARS` characters (a gRPC
  message up to `max_message_bytes` is parsed before the check can run) leaves its buffers
  freed but held by the C allocator's per-thread arenas; `PromptBounds.check` then asks glibc to
  return free memory to the system (a full `gc.collect`, then `malloc_trim`, on the pool,
  `TRIM_DELAY_S` after the last such refusal: once after a flood), so the router's RSS goes
  back to its baseline.
- **Tokenization** runs on a pool of `TOKENIZE_THREADS` threads beside the event loop
  (`PromptBounds.run`): at most that many prompts are tokenized at once, each under the
  character bound, so the tokens made per prompt are at most 4 x max_model_len x
  max_token_bytes (a token is at least one byte) and the memory in use is bounded.

Owner: one `PromptBounds` per routing core (router/routing/core.py `Router.bounds`). Torch-free.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from contracts.requests import BadRequest, GenerateInput
from contracts.tokenizer import ModelTokenizer

T = TypeVar("T")
TOKENIZE_THREADS = 2          # prompts tokenized at once (the rest wait for a thread)
JSON_ESCAPE_BYTES = 6         # the longest JSON spelling of one UTF-8 byte (\u0001)
BODY_SLACK_BYTES = 64 * 1024  # the request's other fields
TRIM_AFTER_CHARS = 1 << 20    # a refused prompt this long gives its memory back (malloc_trim)
TRIM_DELAY_S = 0.5            # after the last refusal: its buffers are freed once its handler returns


def max_token_bytes(tok: ModelTokenizer) -> int:
    """The most UTF-8 bytes one token stands for, +1 (a decoder that strips the leading space
    of a lone token, e.g. SentencePiece's, shows one byte fewer than the token covers).
    A byte-level token cut inside a character decodes to U+FFFD (3 bytes), never fewer than it
    covers, so this is an upper bound. Walks the whole vocabulary: call it in a thread."""
    longest = max((len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
                   for i in range(tok.vocab_size)), default=1)
    return max(longest, 1) + 1


def prompt_chars(inp: GenerateInput) -> int:
    """The characters of a text or chat prompt (0 for token ids, which are counted as tokens)."""
    if inp.text is not None:
        return len(inp.text)
    if inp.chat is not None:
        return sum(len(m.role) + len(m.content) for m in inp.chat)
    return 0


def check_prompt_chars(inp: GenerateInput, max_model_len: int, token_bytes: int) -> None:
    """Raise BadRequest for a prompt too long to fit `max_model_len` tokens by its length
    alone, or a token-id prompt of more ids than the context (before any id is checked)."""
    limit = max_model_len * token_bytes
    n = prompt_chars(inp)
    if n > limit:
        field = "text" if inp.text is not None else "chat"
        raise BadRequest(f"{field}: the prompt has {n} characters; this model takes at most {max_model_len - 1} "
                         f"tokens, which is at most {limit} characters (max_model_len {max_model_len} x "
                         f"{token_bytes} bytes per token)")
    if inp.token_ids is not None and len(inp.token_ids) >= max_model_len:
        raise BadRequest(f"token_ids: the prompt has {len(inp.token_ids)} tokens; this model takes at most "
                         f"{max_model_len - 1} (max_model_len {max_model_len})")


def body_limit(max_model_len: int, token_bytes: int, cap: int) -> int:
    """The HTTP body bound in bytes: the longest prompt that can fit, JSON-escaped, plus the
    other fields; at most `cap` (the router's max_message_bytes)."""
    return min(cap, max_model_len * token_bytes * JSON_ESCAPE_BYTES + BODY_SLACK_BYTES)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`; None on a C library without it (musl, macOS): nothing to trim."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    return getattr(libc, "malloc_trim", None)


class PromptBounds:
    """The tokenization pool of one routing core and the bytes per token of its tokenizers
    (computed once per tokenizer object, on the pool). Used on the router's event loop."""

    def __init__(self, threads: int = TOKENIZE_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="router-tokenize")
        self._token_bytes: weakref.WeakKeyDictionary[ModelTokenizer, int] = weakref.WeakKeyDictionary()
        self._trim = _malloc_trim()
        self._trim_due: asyncio.TimerHandle | None = None

    async def check(self, inp: GenerateInput, max_model_len: int, tok: ModelTokenizer) -> None:
        """`check_prompt_chars` with `tok`'s bytes per token; a refused long prompt schedules
        giving the freed memory back (module docstring). Raises BadRequest."""
        try:
            check_prompt_chars(inp, max_model_len, await self.token_bytes(tok))
        except BadRequest:
            if prompt_chars(inp) > TRIM_AFTER_CHARS:
                self._schedule_trim()
            raise

    def _schedule_trim(self) -> None:
        """Trim `TRIM_DELAY_S` after the last long refusal (each one moves the trim later)."""
        if self._trim is None:
            return
        if self._trim_due is not None:
            self._trim_due.cancel()
        loop = asyncio.get_running_loop()
        self._trim_due = loop.call_later(TRIM_DELAY_S, self._start_trim, loop)

    def _start_trim(self, loop: asyncio.AbstractEventLoop) -> None:
        self._trim_due = None
        loop.run_in_executor(self._pool, self._collect_and_trim)

    def _collect_and_trim(self) -> None:
        # A refused request's text can be held by a reference cycle (an exception's traceback
        # and its frames) until the cyclic collector runs: collect first, then give back.
        gc.collect()
        if self._trim is not None:
            self._trim(0)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the tokenization pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def token_bytes(self, tok: ModelTokenizer) -> int:
        """`max_token_bytes(tok)`, computed on the first call for `tok`."""
        known = self._token_bytes.get(tok)
        if known is None:
            known = self._token_bytes[tok] = await self.run(max_token_bytes, tok)
        return known

    def known_token_bytes(self, tok: ModelTokenizer) -> int | None:
        """`max_token_bytes(tok)` if computed already, else None (no waiting)."""
        return self._token_bytes.get(tok)

    def close(self) -> None:
        if self._trim_due is not None:
            self._trim_due.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
