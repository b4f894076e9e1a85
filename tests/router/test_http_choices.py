"""logprobs, echo, n / best_of and /reset_prefix_cache on the router's HTTP and gRPC.

One real worker (SmolLM2) behind a real router (the `web` fixture). Oracles: HF transformers'
log_softmax on the same weights for every logprob, the gRPC response for the HTTP shapes,
separately seeded requests for n, the worker's cached_tokens for the prefix-cache reset.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch

from proto.kvmesh.v1 import kvmesh_pb2 as pb
from tests.router.test_http import CHAT, COMPLETIONS, PROMPT, _j, post
from tests.router.test_router import LONG_PREFIX, Cluster, greedy, run_generate

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(web: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{web.http_port}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf_logprobs(smollm2_dir: Path) -> Iterator[Any]:
    """ids -> [T, vocab] log_softmax of HF transformers' fp32 logits."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    def fn(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    yield fn


def grpc_all(web: Cluster, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{web.grpc_port}") as ch:
        return list(run_generate(ch, req))


@pytest.mark.server
def test_logprobs_equal_hf_over_grpc_and_http(web: Cluster, client: openai.OpenAI, hf_logprobs: Any) -> None:
    prompt_ids = web.engines[0].encode(PROMPT)
    sampling = greedy(6, logprobs=3, prompt_logprobs=2)
    responses = grpc_all(web, pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), sampling=sampling))
    out = [lp for r in responses for lp in r.logprobs]
    prompt_lps = [lp for r in responses for lp in r.prompt_logprobs]
    ids = prompt_ids + [lp.token_id for lp in out]
    assert [t for r in responses for t in r.token_ids] == ids[len(prompt_ids):]
    want = hf_logprobs(ids)                                     # [T, V]; row t predicts token t + 1
    got = torch.tensor([lp.logprob for lp in prompt_lps + out])
    torch.testing.assert_close(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=2e-3, rtol=0)
    for pos, lp in enumerate(prompt_lps + out):
        k = 2 if pos < len(prompt_lps) else 3
        top = want[pos].topk(k)
        assert [e.token_id for e in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([e.logprob for e in lp.top]), top.values, atol=2e-3, rtol=0)
    # The same request over HTTP, through the openai SDK's typed objects.
    r = client.completions.create(model="smollm2", prompt=prompt_ids, max_tokens=6, temperature=0, logprobs=3,
                                  echo=True)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), got, atol=1e-5, rtol=0)
    assert all(len(t) in (3, 4) for t in lp.top_logprobs[len(prompt_ids):] if t is not None)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert r.choices[0].text == web.router.core.tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.server
def test_echo_loglikelihood_equals_hf_sum(web: Cluster, hf_logprobs: Any) -> None:
    """lm-eval's loglikelihood request: echo + logprobs + max_tokens 0, the continuation's sum."""
    context, continuation = "The capital of France is", " Paris, a city on the Seine."
    ctx_ids, ids = web.engines[0].encode(context), web.engines[0].encode(context + continuation)
    assert ids[:len(ctx_ids)] == ctx_ids
    status, r = post(web.http_port or 0, COMPLETIONS, _j(prompt=context + continuation, max_tokens=0, echo=True,
                                                         logprobs=0, temperature=0))
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["text"] == context + continuation and r["usage"]["completion_tokens"] == 0
    n = len(ids) - len(ctx_ids)
    ours = sum(choice["logprobs"]["token_logprobs"][-n:])
    want = hf_logprobs(ids)[torch.arange(len(ctx_ids) - 1, len(ids) - 1), torch.tensor(ids[len(ctx_ids):])].sum()
    assert abs(ours - float(want)) < 5e-3
    # Asked twice: prompt logprobs bypass the prefix cache, so the answer is the same.
    _, again = post(web.http_port or 0, COMPLETIONS, _j(prompt=context + continuation, max_tokens=0, echo=True,
                                                        logprobs=0))
    assert again["choices"][0]["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]


@pytest.mark.server
def test_chat_logprobs_sdk_stream_and_not(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, temperature=0,  # type: ignore[arg-type]
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.logprob <= 0
        assert c.token == c.top_logprobs[0].token   # greedy: the chosen token is the most likely
    chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8,  # type: ignore[arg-type]
                                                 temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs and choice.logprobs.content
                for c in choice.logprobs.content]
    # The same tokens; the logprobs within fp32 rounding (the streamed request reuses the cached
    # prompt prefix, so its logits come from a different summation order).
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(abs(s.logprob - c.logprob) <= 1e-3 for s, c in zip(streamed, content, strict=True))
    plain = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None
    # Completions, streamed: the chunks' logprobs concatenate to the whole response's.
    whole = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    parts = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                           stream=True))
    tokens = [t for p in parts for ch in p.choices if ch.logprobs for t in (ch.logprobs.tokens or [])]
    assert whole.choices[0].logprobs is not None and tokens == whole.choices[0].logprobs.tokens


@pytest.mark.server
def test_n_choices_are_seeded_sequences(web: Cluster, client: openai.OpenAI) -> None:
    """n=3 with seed s: three choices equal to n=1 requests seeded s, s+1, s+2 (forked after
    one prefill); streamed interleaved the same; usage sums the choices."""
    kw: dict[str, Any] = dict(model="smollm2", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=11)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3
    singles = [client.completions.create(**(kw | {"seed": 11 + i})) for i in range(3)]
    assert texts == [s.choices[0].text for s in singles]
    assert r.usage is not None and r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)  # type: ignore[union-attr]
    parts = list(client.completions.create(n=3, stream=True, **kw))
    joined = ["".join(ch.text for p in parts for ch in p.choices if ch.index == i) for i in range(3)]
    assert joined == texts
    assert sorted(ch.finish_reason for p in parts for ch in p.choices if ch.finish_reason) == ["length"] * 3
    chat = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=6, n=2,  # type: ignore[arg-type]
                                          temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage is not None
    # best_of ranks the sampled sequences by cumulative logprob; with the same seed they are r's.
    ranked = client.completions.create(n=1, best_of=3, logprobs=0, **kw)
    scored = client.completions.create(n=3, logprobs=0, **kw)
    sums = [sum(c.logprobs.token_logprobs) for c in scored.choices]  # type: ignore[union-attr, arg-type]
    assert ranked.choices[0].text == scored.choices[max(range(3), key=lambda i: sums[i])].text
    # gRPC: the same fields, one message stream with `index`.
    responses = grpc_all(web, pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=5, temperature=1.0, seed=11, n=3)))
    by_index = ["".join(m.text for m in responses if m.index == i) for i in range(3)]
    assert by_index == texts and responses[-1].finished
    assert sum(m.sequence_finished for m in responses) == 3


@pytest.mark.server
def test_reset_prefix_cache(web: Cluster) -> None:
    port = web.http_port or 0
    body = _j(prompt=LONG_PREFIX + "Where is Porto?", max_tokens=1, temperature=0)
    post(port, COMPLETIONS, body)
    _, r = post(port, COMPLETIONS, body)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    status, reset = post(port, "/reset_prefix_cache", b"")
    assert status == 200 and reset == {"reset": {"worker-0": True}}
    _, r = post(port, COMPLETIONS, body)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.server
def test_reset_prefix_cache_needs_admin_key(web: Cluster) -> None:
    import urllib.error
    import urllib.request

    from router.config import RouterConfig
    from router.security.auth import ApiKey, TenantId
    from router.server import RouterServer
    keys = (ApiKey("user-key"), ApiKey("ops-key", TenantId("ops"), admin=True))
    cfg = RouterConfig(worker_addresses=tuple(web.worker_addresses), model=str(web.model_dir),
                       served_model_name="smollm2", http_port=0, api_keys=keys)
    router = RouterServer(cfg)
    _, port = web.lt.run(router.start())
    try:
        web.lt.run(router.wait_ready(10))

        def call(key: str) -> tuple[int, Any]:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", data=b"", method="POST",
                                         headers={"Authorization": f"Bearer {key}"})
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    return resp.status, json.loads(resp.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())
        status, body = call("user-key")
        assert status == 403 and body["error"]["code"] == "forbidden"
        assert call("nope")[0] == 401
        assert call("ops-key") == (200, {"reset": {"worker-0": True}})
    finally:
        web.lt.run(router.stop(1))


CHOICE_BODIES = [  # refused-by-design fields, as harnesses send them: all 200
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "logprobs": 5}),
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}),
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 3, "n": 2, "stream": True}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 5, "stream": True}),
    (CHAT, {"messages": MESSAGES, "max_tokens": 4, "n": 2}),
]


@pytest.mark.server
@pytest.mark.parametrize("i", range(len(CHOICE_BODIES)))
def test_choice_bodies_replay_200(web: Cluster, i: int) -> None:
    path, body = CHOICE_BODIES[i]
    if body.get("stream"):
        import urllib.request
        req = urllib.request.Request(f"http://127.0.0.1:{web.http_port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and b'"error"' not in r.read()
        return
    status, r = post(web.http_port or 0, path, json.dumps(body).encode())
    assert status == 200, r
    assert len(r["choices"]) == body.get("n", 1)


@pytest.mark.server
def test_spaces_between_special_tokens_over_http_and_grpc(web: Cluster) -> None:
    body: dict[str, Any] = dict(messages=[{"role": "user", "content": "Hi!"}], max_tokens=12, temperature=0,
                                ignore_eos=True, skip_special_tokens=False)
    _, joined = post(web.http_port or 0, CHAT, _j(**body, spaces_between_special_tokens=False))
    _, spaced = post(web.http_port or 0, CHAT, _j(**body))          # vLLM's default: true
    a, b = joined["choices"][0]["message"]["content"], spaced["choices"][0]["message"]["content"]
    assert "<|im_end|>" in a and " <|im_end|>" in b and a != b and a.replace(" ", "") == b.replace(" ", "")
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi!")])
    sampling = greedy(12, ignore_eos=True, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert "".join(m.text for m in grpc_all(web, pb.GenerateRequest(chat=chat, sampling=sampling))) == a


BAD_GRPC = {  # the same validation as HTTP (contracts.sampling), as INVALID_ARGUMENT naming the field
    "n": pb.SamplingParams(n=17),
    "best_of": pb.SamplingParams(n=3, best_of=2),
    "logprobs": pb.SamplingParams(logprobs=21),
    "prompt_logprobs": pb.SamplingParams(prompt_logprobs=-1),
    "max_tokens": pb.SamplingParams(max_tokens=0),
}


@pytest.mark.server
@pytest.mark.parametrize("field", list(BAD_GRPC))
def test_grpc_rejects_the_same_values(web: Cluster, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        grpc_all(web, pb.GenerateRequest(text=PROMPT, sampling=BAD_GRPC[field]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (err.value.details() or "")
    assert grpc_all(web, pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=0, prompt_logprobs=0)))[-1].finished        # max_tokens 0 is fine with prompt logprobs


def test_keys_file_admin_flag(tmp_path: Path) -> None:
    from router.security.auth import parse_keys_file
    f = tmp_path / "keys"
    f.write_text("k1 ops admin\nk2 team priority admin\nk3 team priority\nk4 plain\n")
    assert [(k.priority, k.admin) for k in parse_keys_file(f)] == [
        (False, True), (True, True), (True, False), (False, False)]
    for bad in ("k1 ops root\n", "k1 ops admin admin\n", "k1\n"):
        f.write_text(bad)
        with pytest.raises(ValueError, match="admin"):
            parse_keys_file(f)
