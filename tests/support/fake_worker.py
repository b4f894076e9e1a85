"""An in-process fake worker for router tests that need no engine: a grpc.aio server on
127.0.0.1:0 with the Worker RPCs the router calls (health, GetLoad, GetModelInfo, GetTokenizer,
Generate), a readiness the test flips, and — with a Redis — a registry record and a KV event
stream written with the real kvstore classes (WorkerRegistry, EventPublisher).

Also `tiny_tokenizer_files()`: a small word-level HF tokenizer (tokenizer.json +
tokenizer_config.json with a chat template), built with `tokenizers`, no download.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contracts.tokenizer import tokenizer_files_digest
from kvstore.events import EventType, Tier, WireEvent, WorkerId
from kvstore.keys import BlockHash
from kvstore.metadata.publisher import EventPublisher
from kvstore.metadata.registry import RedisConfig, WorkerRecord, WorkerRegistry
from proto.kvmesh.v1 import kvmesh_pb2 as pb

WORKER = "kvmesh.v1.Worker"


def worker_handlers(generate: Any, unary: dict[str, tuple[Any, Any, Any]]) -> grpc.GenericRpcHandler:
    """A `kvmesh.v1.Worker` service of hand-written methods: `generate` (request → stream of
    GenerateResponse) and `unary` (method name → (handler, request type, response type))."""
    methods = {name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=req.FromString,
                                                         response_serializer=resp.SerializeToString)
               for name, (fn, req, resp) in unary.items()}
    methods["Generate"] = grpc.unary_stream_rpc_method_handler(
        generate, request_deserializer=pb.GenerateRequest.FromString,
        response_serializer=pb.GenerateResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(WORKER, methods)


WORDS = ("hello", "world", "the", "capital", "of", "france", "is", "paris", "user", "assistant", ":", "a", "b")


def tiny_tokenizer_files() -> dict[str, bytes]:
    """tokenizer.json (word level, whitespace split, [UNK] 0, </s> 1) and tokenizer_config.json
    with a chat template; ~2 KB."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1} | {w: i + 2 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    config = {"eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                                                    "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"}
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()}


@dataclass
class FakeWorker:
    """Call `start()` on the test's loop; `set_serving` flips readiness; `register` puts it in
    Redis and starts answering the router's inventory requests."""

    worker_id: str
    files: dict[str, bytes] = field(default_factory=tiny_tokenizer_files)
    hash_salt_hex: str = "ab"
    model: str = "tiny"
    block_size: int = 4
    sha256: str | None = None               # ModelInfo.tokenizer_sha256; None: the files' digest
    sent_sha256: str | None = None          # TokenizerFiles.sha256; None: the files' digest
    sent_files: dict[str, bytes] | None = None   # what GetTokenizer sends; None: `files`
    tokenizer_gate: asyncio.Event | None = None  # GetTokenizer waits for it when set
    cut_streams: int = 0                    # this many Generate calls stream a token, then UNAVAILABLE
    delay_s: float = 0.0                    # each Generate takes this long before its finished response
    calls: dict[str, int] = field(default_factory=dict)
    prompts: list[list[int]] = field(default_factory=list)
    requests: list[pb.GenerateRequest] = field(default_factory=list)   # every Generate request, as received
    blocks: list[BlockHash] = field(default_factory=list)     # its device blocks (inventory)
    num_preemptions: int = 0                # what GetLoad reports
    server: grpc.aio.Server | None = None
    port: int = 0
    publisher: EventPublisher | None = None
    registry: WorkerRegistry | None = None
    _health: Any = None
    _poller: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def digest(self) -> str:
        return tokenizer_files_digest(self.files)

    def model_info(self) -> pb.ModelInfo:
        return pb.ModelInfo(model=self.model, vocab_size=64, max_model_len=512, block_size=self.block_size,
                            hash_salt_hex=self.hash_salt_hex, eos_token_ids=[1],
                            tokenizer_sha256=self.digest if self.sha256 is None else self.sha256)

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    async def start(self, serving: bool = True) -> int:
        async def get_load(req: pb.LoadRequest, context: Any) -> pb.Load:
            self._count("GetLoad")
            return pb.Load(worker_id=self.worker_id, num_blocks=64, num_free_blocks=64,
                           num_preemptions=self.num_preemptions)

        async def get_model_info(req: pb.ModelInfoRequest, context: Any) -> pb.ModelInfo:
            self._count("GetModelInfo")
            return self.model_info()

        async def get_tokenizer(req: pb.TokenizerRequest, context: Any) -> pb.TokenizerFiles:
            self._count("GetTokenizer")
            if self.tokenizer_gate is not None:
                await self.tokenizer_gate.wait()
            files = self.files if self.sent_files is None else self.sent_files
            return pb.TokenizerFiles(model=self.model, hash_salt_hex=self.hash_salt_hex, files=files,
                                     sha256=self.digest if self.sent_sha256 is None else self.sent_sha256)

        async def generate(req: pb.GenerateRequest, context: Any) -> AsyncIterator[pb.GenerateResponse]:
            self._count("Generate")
            self.prompts.append(list(req.token_ids.ids))
            self.requests.append(req)
            if self.cut_streams > 0:
                self.cut_streams -= 1
                yield pb.GenerateResponse(request_id=req.request_id, token_ids=[9], text="paris",
                                          worker_id=self.worker_id)
                await context.abort(grpc.StatusCode.UNAVAILABLE, "engine restarting (test)")
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield pb.GenerateResponse(request_id=req.request_id, token_ids=[9], text="paris", finished=True,
                                      finish_reason=pb.FINISH_REASON_STOP, prompt_tokens=len(req.token_ids.ids),
                                      completion_tokens=1, worker_id=self.worker_id)

        handlers = worker_handlers(generate, {
            "GetLoad": (get_load, pb.LoadRequest, pb.Load),
            "GetModelInfo": (get_model_info, pb.ModelInfoRequest, pb.ModelInfo),
            "GetTokenizer": (get_tokenizer, pb.TokenizerRequest, pb.TokenizerFiles)})
        self.server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * 2**20)])
        self.server.add_generic_rpc_handlers((handlers,))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self.server)
        await self.set_serving(serving)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", WORKER):
            await self._health.set(service, status)

    # -- Redis: the registry record and the event stream --------------------------------------
    def register(self, redis_url: str, cluster_name: str = "kvmesh") -> None:
        """Register (record + liveness key, epoch) and start the event publisher; its first
        flush is an inventory of `blocks`. Sync: call it through asyncio.to_thread."""
        rcfg = RedisConfig(url=redis_url, cluster_name=cluster_name)
        self.registry = WorkerRegistry(rcfg)
        wid = WorkerId(self.worker_id)
        epoch = self.registry.new_epoch(wid)
        self.registry.register(WorkerRecord(wid, self.address, self.model, self.block_size, 64,
                                            self.hash_salt_hex, epoch))
        self.publisher = EventPublisher(rcfg, wid, epoch, inventory_fn=lambda: {Tier.DEVICE: list(self.blocks)})
        self.publisher.poll()

    def run_publisher(self) -> None:
        """Serve inventory requests (EventPublisher.poll) every 20 ms, on the test's loop."""
        async def loop() -> None:
            while True:
                assert self.publisher is not None
                await asyncio.to_thread(self.publisher.poll)
                await asyncio.sleep(0.02)
        self._poller = asyncio.create_task(loop())

    async def store(self, hashes: list[BlockHash]) -> None:
        """The worker stored `hashes` in its device tier (a BlockStored event)."""
        assert self.publisher is not None
        self.blocks += hashes
        await asyncio.to_thread(self.publisher.publish_wire, [WireEvent(EventType.STORED, tuple(hashes))])

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.publisher is not None:
            self.publisher.close()
        if self.registry is not None:
            self.registry.close()
        if self.server is not None:
            await self.server.stop(None)
