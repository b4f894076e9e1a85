"""`kvmesh client generate`: stream one generation from a router (or a worker) over gRPC.

Both services serve `Generate`; the client calls `kvmesh.v1.Router` and falls back to
`kvmesh.v1.Worker` when the target answers UNIMPLEMENTED. torch-free.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import grpc

from contracts.cli import CLIError, flagify
from contracts.tls import TlsConfig
from contracts.wire import FINISH_REASON_NAMES
from proto.kvmesh.v1 import kvmesh_pb2 as pb, kvmesh_pb2_grpc as pb_grpc


class ClientError(Exception):
    """One line for the user (the command exits 1)."""


class GenerateResult(NamedTuple):
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    worker_id: str


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="client_command", required=True, metavar="{generate}")
    g = sub.add_parser("generate", help="generate text through a router or a worker")
    g.add_argument("prompt", help="prompt text")
    g.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of a router or worker (gRPC)")
    g.add_argument("--chat", action="store_true", help="send the prompt as one user message (chat template)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--request-id", default="", help="request id (the router makes one up if empty)")
    g.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole call, seconds")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                   help="connect over TLS, trusting this CA (a router started with --tls-cert)")


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sp = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    if args.top_p is not None:
        sp.top_p = args.top_p
    if args.seed is not None:
        sp.seed = args.seed
    req = pb.GenerateRequest(request_id=args.request_id, sampling=sp)
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.text = args.prompt
    return req


def generate(channel: grpc.Channel, request: pb.GenerateRequest, timeout: float,
             on_text: Callable[[str], None] | None = None) -> GenerateResult:
    """Run one Generate (Router, else Worker); `on_text(str)` sees each new piece of text.
    Raises grpc.RpcError with the server's status."""
    for stub in (pb_grpc.RouterStub(channel), pb_grpc.WorkerStub(channel)):
        ids: list[int] = []
        text: list[str] = []
        try:
            for r in stub.Generate(request, timeout=timeout):
                ids.extend(r.token_ids)
                text.append(r.text)
                if r.text and on_text is not None:
                    on_text(r.text)
                if r.finished:
                    return GenerateResult(ids, "".join(text), FINISH_REASON_NAMES.get(r.finish_reason),
                                          r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.worker_id)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED and isinstance(stub, pb_grpc.RouterStub):
                continue
            raise
        raise ClientError("the stream ended without a finished response")
    raise ClientError("the target serves neither kvmesh.v1.Router nor kvmesh.v1.Worker")


def run_client(args: argparse.Namespace) -> int:
    request = build_request(args)
    try:
        tls = TlsConfig(ca=args.tls_ca)
    except ValueError as e:
        raise CLIError(flagify(str(e))) from None
    with tls.sync_channel(args.target) as channel:
        def write(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()
        try:
            result = generate(channel, request, args.timeout, None if args.json else write)
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                print(f"kvmesh client: --target {args.target}: unavailable ({e.details()})", file=sys.stderr)
            else:
                print(f"kvmesh client: {code.name}: {e.details()}", file=sys.stderr)
            return 1
        except ClientError as e:
            print(f"kvmesh client: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text, "finish_reason": result.finish_reason,
                          "num_cached_tokens": result.cached_tokens, "prompt_tokens": result.prompt_tokens,
                          "completion_tokens": result.completion_tokens, "worker_id": result.worker_id}))
    else:
        sys.stdout.write("\n")
    print(f"kvmesh client: {result.completion_tokens} tokens (prompt {result.prompt_tokens}, "
          f"cached {result.cached_tokens}) from {result.worker_id or '?'}, finish {result.finish_reason}",
          file=sys.stderr)
    return 0
