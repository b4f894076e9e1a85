"""What a worker server derives once its engine is loaded: the peer plane, the tokenizer files
`GetTokenizer` sends, and the `ModelInfo` `GetModelInfo` answers (worker/server/service.py calls these
from its load task). Blocking functions: the server runs them in a thread. Torch-free at import.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from contracts.tokenizer import TokenizerError, read_tokenizer_files, tokenizer_files_digest
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from worker.server.config import WorkerServerConfig
from worker.server.responses import tokenizer_response

if TYPE_CHECKING:
    from worker.engine.engine import Engine
    from worker.peer.plane import PeerPlane

log = logging.getLogger("kvmesh.worker")


def read_tokenizer(worker_id: str, engine: Engine) -> pb.TokenizerFiles | TokenizerError:
    """What GetTokenizer answers, read once: the model's tokenizer files (at most
    contracts.tokenizer.MAX_TOKENIZER_BYTES), or the error that says why there are none."""
    if engine.tokenizer is None:
        return TokenizerError(f"the model {engine.model_config.name} has no tokenizer (tokenizer.json)")
    try:
        files = read_tokenizer_files(engine.model_dir)
    except TokenizerError as e:
        log.warning("worker %s: GetTokenizer will refuse: %s", worker_id, e)
        return e
    return tokenizer_response(engine.model_config.name, engine.salt.hex(), files, tokenizer_files_digest(files))


def model_info(engine: Engine, tokenizer: pb.TokenizerFiles | TokenizerError) -> pb.ModelInfo:
    mc = engine.model_config
    return pb.ModelInfo(
        model=mc.name, vocab_size=mc.vocab_size, max_model_len=engine.max_model_len,
        block_size=engine.cfg.block_size, kv_cache_dtype=engine.layout.kv_cache_dtype,
        eos_token_ids=sorted(engine.eos_token_ids), hash_salt_hex=engine.salt.hex(),
        attention_backend=engine.runner.attention_backend.value,
        tokenizer_sha256=tokenizer.sha256 if isinstance(tokenizer, pb.TokenizerFiles) else "")


def start_peer(cfg: WorkerServerConfig, engine: Engine) -> PeerPlane | None:
    """The peer plane of `engine` (before its engine thread starts), or None when its
    rendezvous store cannot start (the worker then serves without peer transfer)."""
    from kvstore.transfer.group import TransferConfig, TransferError
    from worker.peer.config import PeerConfig
    from worker.peer.plane import PeerPlane
    advertise_host = cfg.advertise_address.rpartition(":")[0] if cfg.advertise_address else None
    timeout = cfg.transfer_timeout_s
    peer_cfg = PeerConfig(cfg.worker_id, TransferConfig(timeout_s=timeout, connect_timeout_s=timeout),
                          store_host=cfg.host, store_port=cfg.transfer_port,
                          advertise_host=advertise_host, faults=cfg.transfer_faults)
    try:
        return PeerPlane.start(peer_cfg, engine)
    except TransferError as e:
        log.error("worker %s: no peer transfer (serving without it): %s", cfg.worker_id, e)
        return None
