"""`make demo`: the capacity planner, then a real local cluster (redis + 2 workers + router)
answering chat requests over gRPC and OpenAI HTTP, with the shared prefix served from cache.

Exits 0 when everything worked and the repeated prefix was a cache hit; non-zero with the
reason otherwise.
"""
from __future__ import annotations

import sys
import textwrap
import time
from typing import NamedTuple

import grpc

from contracts.cluster_token import new_token
from kvmesh.cli import main as kvmesh
from kvmesh.client import ClientError, GenerateResult, generate
from kvmesh.serve.config import ServeConfig
from kvmesh.serve.local import LocalCluster
from kvmesh.serve.processes import LaunchError
from kvstore.metadata.registry import parse_redis_url
from proto.kvmesh.v1 import kvmesh_pb2 as pb
from router.observe.metrics import sample_sum, scrape

# Long enough to fill several 16-token blocks (the router routes on the first 4 blocks, so
# requests sharing it land on the same worker, which then finds its blocks in its cache).
SYSTEM_PROMPT = (
    "You are a patient teacher of computer systems. You answer questions about how large "
    "language models are served in production: memory, batching, caching and scheduling. "
    "Keep every answer to one or two plain sentences, avoid jargon where a simpler word "
    "works, and never use lists, headings or code. If you are not sure, say so briefly."
)
QUESTIONS = (
    "What does a KV cache store?",
    "Why does a longer context use more GPU memory?",
    "What is continuous batching?",
)
HTTP_QUESTION = "What is prefix caching good for?"
MAX_TOKENS = 40


class DemoFailure(Exception):
    """The demo could not show what it promises; the message says why."""


class Answer(NamedTuple):
    text: str
    prompt_tokens: int
    cached_tokens: int
    worker_id: str


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def ask_grpc(target: str, question: str) -> Answer:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    for m in _messages(question):
        request.chat.messages.add(role=m["role"], content=m["content"])
    with grpc.insecure_channel(target) as channel:
        r: GenerateResult = generate(channel, request, timeout=120.0)
    return Answer(r.text, r.prompt_tokens, r.cached_tokens, r.worker_id)


def ask_http(base_url: str, model: str, question: str) -> Answer:
    from openai import OpenAI  # the test extra: only this step of the demo needs it
    client = OpenAI(base_url=base_url, api_key="kvmesh-demo", max_retries=0, timeout=120.0)
    resp = client.chat.completions.create(model=model, messages=_messages(question),  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, temperature=0.0)
    usage = resp.usage
    cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
    worker = str((resp.model_extra or {}).get("kvmesh", {}).get("worker_id", "?"))
    return Answer(resp.choices[0].message.content or "", usage.prompt_tokens if usage else 0, cached or 0, worker)


def show(label: str, question: str, a: Answer) -> None:
    print(f"\n[{label}] Q: {question}")
    print(textwrap.fill(a.text.strip(), width=96, initial_indent="    A: ", subsequent_indent="       "))
    print(f"    -> {a.worker_id}: prompt {a.prompt_tokens} tokens, {a.cached_tokens} served from its KV cache",
          flush=True)


def show_metrics(cluster: LocalCluster) -> None:
    """What the requests moved, scraped from each worker's and the router's /metrics."""
    base = cluster.http_base_url.removesuffix("/v1")
    print(f"\n$ curl {base}/metrics  (and each worker's /metrics; live view: {base}/dashboard)")
    for i, port in enumerate(cluster.local_placement.metrics_ports):
        s = scrape(f"http://127.0.0.1:{port}/metrics")
        hits, queries = (sample_sum(s, f"kvmesh:prefix_cache_{k}_total") for k in ("hits", "queries"))
        print(f"  worker-{i}: kvmesh:prefix_cache_hits_total {hits:.0f} of kvmesh:prefix_cache_queries_total "
              f"{queries:.0f} prompt tokens, kvmesh:generation_tokens_total "
              f"{sample_sum(s, 'kvmesh:generation_tokens_total'):.0f}, kvmesh:kv_cache_usage_perc "
              f"{sample_sum(s, 'kvmesh:kv_cache_usage_perc'):.3f}")
    r = scrape(f"{base}/metrics")
    print(f"  router:   kvmesh:router_requests_total {sample_sum(r, 'kvmesh:router_requests_total'):.0f}, "
          f"kvmesh:router_predicted_hit_tokens_total {sample_sum(r, 'kvmesh:router_predicted_hit_tokens_total'):.0f}"
          f" vs kvmesh:router_served_hit_tokens_total {sample_sum(r, 'kvmesh:router_served_hit_tokens_total'):.0f}",
          flush=True)


def weights_line(model: str) -> str:
    """What the workers run: the model's weights in their own format (--weight-dtype auto, the default)."""
    from worker.model.loader import load_weights, resolve_model_dir
    from worker.model.runner import weight_bytes_fp32

    loaded = load_weights(resolve_model_dir(model, progress=False), weight_dtype="auto")
    return (f"weights: the shipped GGUF's own blocks, {loaded.weight_format} tensors (--weight-dtype auto): "
            f"{loaded.weight_bytes / 2**20:.0f} MiB per worker, fp32 would take "
            f"{weight_bytes_fp32(loaded.config) / 2**20:.0f} MiB")


def run_cluster() -> None:
    cfg = ServeConfig(workers=2, grpc_port=0, http_port=0, cluster_name="kvmesh-demo",
                      cluster_token=new_token())     # as `kvmesh serve` makes one per start
    print("\n$ kvmesh serve --workers 2   # as a LocalCluster on free ports: redis-server, 2 workers, router")
    started = time.monotonic()
    with LocalCluster(cfg) as cluster:
        print(f"cluster up in {time.monotonic() - started:.0f} s: gRPC {cluster.grpc_target}, "
              f"HTTP {cluster.http_base_url}, workers {' '.join(cluster.worker_addresses)}, "
              f"redis {parse_redis_url(cluster.redis_url).redacted()}", flush=True)
        print(weights_line(cfg.model))
        print(f"\nEvery request shares one system prompt ({len(SYSTEM_PROMPT)} characters); "
              f"greedy, at most {MAX_TOKENS} new tokens.")
        grpc_answers = []
        for i, q in enumerate(QUESTIONS, 1):
            a = ask_grpc(cluster.grpc_target, q)
            show(f"gRPC {i}", q, a)
            grpc_answers.append(a)
        a = ask_http(cluster.http_base_url, cfg.model, HTTP_QUESTION)
        show("HTTP openai", HTTP_QUESTION, a)
        first, second = grpc_answers[0], grpc_answers[1]
        if second.cached_tokens <= 0:
            raise DemoFailure(f"the second request with the same system prompt was not served from cache "
                              f"(cached_tokens=0 on {second.worker_id}; the first ran on {first.worker_id})")
        print("\n" + textwrap.fill(
            f"Cache: request 2 reused {second.cached_tokens} of its {second.prompt_tokens} prompt tokens: the "
            f"full 16-token blocks of the shared system prompt, left in {second.worker_id}'s KV pool by "
            f"request 1. The router sent it to the worker holding that prefix, so only the rest was prefilled.",
            width=100))
        show_metrics(cluster)
        print("\nstopping the cluster ...", flush=True)
    print("stopped: router, workers and redis-server have exited.")


def run() -> int:
    print("$ kvmesh plan --model smollm2-135m --context 8192 --batch 16 --gpu-memory 4 --weights-dtype q4_1",
          flush=True)
    rc = kvmesh(["plan", "--model", "smollm2-135m", "--context", "8192", "--batch", "16", "--gpu-memory", "4",
                 "--weights-dtype", "q4_1"])
    if rc:
        print(f"demo failed: kvmesh plan exited with {rc}", file=sys.stderr)
        return rc
    try:
        run_cluster()
    except (DemoFailure, LaunchError, ClientError) as e:
        print(f"\ndemo failed: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"\ndemo failed: gRPC {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndemo interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the openai client's errors and anything unexpected: say what, exit non-zero
        print(f"\ndemo failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run())
