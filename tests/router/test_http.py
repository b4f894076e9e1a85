"""The router's OpenAI-compatible HTTP, driven by the official `openai` client and by raw HTTP.

One real worker (SmolLM2) behind a real router on 127.0.0.1:0; the oracle for every HTTP
generation is the same request over the router's gRPC.
"""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from proto.kvmesh.v1 import kvmesh_pb2 as pb
from tests.router.test_router import LONG_PREFIX, Cluster, greedy, run_generate, summary, used_blocks, wait_until

PROMPT = "The best thing about living near the sea is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où se trouve Zürich ? 🏔"}]


@pytest.fixture(scope="module")
def client(web: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{web.http_port}/v1", api_key="x", max_retries=0, timeout=60)


def grpc_text(web: Cluster, req: pb.GenerateRequest) -> tuple[str, pb.GenerateResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{web.grpc_port}") as ch:
        _, text, last = summary(run_generate(ch, req))
    return text, last


@pytest.mark.server
def test_completions_equals_grpc(web: Cluster, client: openai.OpenAI) -> None:
    want, last = grpc_text(web, pb.GenerateRequest(text=PROMPT, sampling=greedy(10)))
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=10, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "smollm2"
    assert r.choices[0].text == want and r.choices[0].index == 0 and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.prompt_tokens == last.prompt_tokens
    assert r.usage.completion_tokens == 10 and r.usage.total_tokens == last.prompt_tokens + 10
    assert r.model_extra is not None and r.model_extra["kvmesh"]["worker_id"] == "worker-0"
    # The same prompt as token ids, and OpenAI's default max_tokens (16).
    ids = web.engines[0].encode(PROMPT)
    r2 = client.completions.create(model="smollm2", prompt=ids, temperature=0)
    assert r2.choices[0].text.startswith(want) and r2.usage is not None and r2.usage.completion_tokens == 16


@pytest.mark.server
def test_chat_equals_grpc(web: Cluster, client: openai.OpenAI) -> None:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    want, last = grpc_text(web, pb.GenerateRequest(chat=chat, sampling=greedy(12)))
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_completion_tokens=12,  # type: ignore[arg-type]
                                       temperature=0, user="someone", seed=3)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage is not None and r.usage.prompt_tokens == last.prompt_tokens


@pytest.mark.server
def test_streams_with_usage(web: Cluster, client: openai.OpenAI) -> None:
    want = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])

    want_chat = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12,  # type: ignore[arg-type]
                                               temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12,  # type: ignore[arg-type]
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # Without include_usage: no usage chunk.
    plain = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=3,  # type: ignore[arg-type]
                                                temperature=0, stream=True))
    assert all(c.choices and c.usage is None for c in plain)


@pytest.mark.server
def test_cached_tokens_on_repeated_prefix(client: openai.OpenAI) -> None:
    usages = [client.completions.create(model="smollm2", prompt=LONG_PREFIX + q, max_tokens=2, temperature=0).usage
              for q in ("Where is Porto?", "Where is Gdansk?")]
    assert usages[1] is not None and usages[1].prompt_tokens_details is not None
    assert usages[1].prompt_tokens_details.cached_tokens >= 64  # four blocks of 16


@pytest.mark.server
def test_models_and_health(web: Cluster, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["smollm2"]
    with urllib.request.urlopen(f"http://127.0.0.1:{web.http_port}/health", timeout=10) as r:
        assert r.status == 200


def post(port: int, path: str, body: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _j(**kw: Any) -> bytes:
    return json.dumps({"model": "smollm2"} | kw).encode()


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD: dict[str, tuple[str, bytes, int]] = {
    "invalid json": (COMPLETIONS, b'{"prompt": "hi",', 400),
    "not an object": (COMPLETIONS, b'["hi"]', 400),
    "invalid utf-8": (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400),
    "NaN literal": (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', 400),
    "empty prompt": (COMPLETIONS, _j(prompt=""), 400),
    "empty token list": (COMPLETIONS, _j(prompt=[]), 400),
    "no prompt": (COMPLETIONS, _j(), 400),
    "token id outside vocab": (COMPLETIONS, _j(prompt=[1, 10**6]), 400),
    "prompt over max_model_len": (COMPLETIONS, _j(prompt=[42] * 9000), 400),
    "max_tokens 0": (COMPLETIONS, _j(prompt="hi", max_tokens=0), 400),
    "max_tokens string": (COMPLETIONS, _j(prompt="hi", max_tokens="5"), 400),
    "max_tokens over int32": (COMPLETIONS, _j(prompt="hi", max_tokens=2**40), 400),
    "negative temperature": (COMPLETIONS, _j(prompt="hi", temperature=-0.5), 400),
    "top_p 0": (COMPLETIONS, _j(prompt="hi", top_p=0), 400),
    "presence_penalty 3": (COMPLETIONS, _j(prompt="hi", presence_penalty=3), 400),
    "n over the cap": (COMPLETIONS, _j(prompt="hi", n=17), 400),
    "best_of under n": (COMPLETIONS, _j(prompt="hi", n=3, best_of=2), 400),
    "best_of streamed": (COMPLETIONS, _j(prompt="hi", n=1, best_of=2, stream=True), 400),
    "echo string": (COMPLETIONS, _j(prompt="hi", echo="yes"), 400),
    "logprobs 21": (COMPLETIONS, _j(prompt="hi", logprobs=21), 400),
    "chat logprobs number": (CHAT, _j(messages=[{"role": "user", "content": "hi"}], logprobs=3), 400),
    "top_logprobs without logprobs": (CHAT, _j(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), 400),
    "stream not bool": (COMPLETIONS, _j(prompt="hi", stream="yes"), 400),
    "empty stop string": (COMPLETIONS, _j(prompt="hi", stop=[""]), 400),
    "unknown model": (COMPLETIONS, json.dumps({"model": "gpt-9", "prompt": "hi"}).encode(), 404),
    "no messages": (CHAT, _j(messages=[]), 400),
    "bad role": (CHAT, _j(messages=[{"role": "wizard", "content": "hi"}]), 400),
    "tools": (CHAT, _j(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "function"}]), 400),
    "image part": (CHAT, _j(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400),
    "over 4 MiB": (COMPLETIONS, _j(prompt="x" * (5 * 2**20)), 413),
    # vLLM's extras: invalid values of known fields are 400s naming the field.
    "top_k -5": (COMPLETIONS, _j(prompt="hi", top_k=-5), 400),
    "min_p 2": (COMPLETIONS, _j(prompt="hi", min_p=2), 400),
    "repetition_penalty 0": (CHAT, _j(messages=[{"role": "user", "content": "hi"}], repetition_penalty=0), 400),
    "stop_token_ids strings": (COMPLETIONS, _j(prompt="hi", stop_token_ids=["a"]), 400),
    "stop_token_ids outside vocab": (COMPLETIONS, _j(prompt="hi", stop_token_ids=[10**6]), 400),
    "min_tokens over max_tokens": (COMPLETIONS, _j(prompt="hi", max_tokens=2, min_tokens=3), 400),
    "ignore_eos string": (CHAT, _j(messages=[{"role": "user", "content": "hi"}], ignore_eos="yes"), 400),
    "priority string": (COMPLETIONS, _j(prompt="hi", priority="high"), 400),
    "cache_salt number": (COMPLETIONS, _j(prompt="hi", cache_salt=5), 400),
    "truncate_prompt_tokens 0": (COMPLETIONS, _j(prompt="hi", truncate_prompt_tokens=0), 400),
    "add_special_tokens string": (COMPLETIONS, _j(prompt="hi", add_special_tokens="no"), 400),
    "stream_options bad key": (COMPLETIONS, _j(prompt="hi", stream=True, stream_options={"x": 1}), 400),
}
BAD_PARAM = {"top_k -5": "top_k", "min_p 2": "min_p", "repetition_penalty 0": "repetition_penalty",
             "stop_token_ids strings": "stop_token_ids", "min_tokens over max_tokens": "min_tokens",
             "ignore_eos string": "ignore_eos", "priority string": "priority", "cache_salt number": "cache_salt",
             "truncate_prompt_tokens 0": "truncate_prompt_tokens", "add_special_tokens string": "add_special_tokens",
             "n over the cap": "n", "best_of under n": "best_of", "best_of streamed": "best_of",
             "echo string": "echo", "logprobs 21": "logprobs", "chat logprobs number": "logprobs",
             "top_logprobs without logprobs": "top_logprobs"}


@pytest.mark.server
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_openai_error_and_server_keeps_serving(web: Cluster, case: str) -> None:
    path, body, status = BAD[case]
    got, payload = post(web.http_port or 0, path, body)
    assert got == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if case in BAD_PARAM:
        assert error["param"] == BAD_PARAM[case], error
    ok, answer = post(web.http_port or 0, COMPLETIONS, _j(prompt="Hi", max_tokens=2, temperature=0))
    assert ok == 200 and answer["usage"]["completion_tokens"] == 2


@pytest.mark.server
def test_client_disconnect_mid_stream_cancels_upstream(web: Cluster) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", web.http_port, timeout=30)
    body = _j(prompt="Count to a thousand:", max_tokens=1000, temperature=0, stream=True)
    conn.request("POST", COMPLETIONS, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    assert resp.readline().startswith(b"data: ")
    assert used_blocks(web.worker_addresses[0]) > 0
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    assert wait_until(lambda: used_blocks(web.worker_addresses[0]) == 0), "the worker still runs the request"


@pytest.mark.server
def test_no_worker_is_503(web: Cluster) -> None:
    from router.config import RouterConfig
    from router.server import RouterServer
    cfg = RouterConfig(worker_addresses=("127.0.0.1:1",), model=str(web.model_dir), served_model_name="smollm2",
                       http_port=0)
    router = RouterServer(cfg, tokenizer=web.router.core.tokenizer)
    _, port = web.lt.run(router.start())
    try:
        assert port is not None
        status, payload = post(port, COMPLETIONS, _j(prompt="hi"))
        assert status == 503 and payload["error"]["message"]
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        assert err.value.code == 503
    finally:
        web.lt.run(router.stop(0))


# -- vLLM's extra fields -----------------------------------------------------
def grpc_ids(web: Cluster, req: pb.GenerateRequest) -> tuple[list[int], str, pb.GenerateResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{web.grpc_port}") as ch:
        return summary(run_generate(ch, req))


@pytest.mark.server
def test_vllm_sampling_fields_take_effect_over_grpc_and_http(web: Cluster) -> None:
    """Each field's effect, with the plain greedy continuation as the oracle."""
    port = web.http_port or 0
    base, base_text, _ = grpc_ids(web, pb.GenerateRequest(text=PROMPT, sampling=greedy(12)))
    first = base[0]
    # stop_token_ids: ends at the first occurrence, finish "stop" (gRPC and HTTP agree).
    ids, _, last = grpc_ids(web, pb.GenerateRequest(text=PROMPT, sampling=greedy(12, stop_token_ids=[first])))
    assert ids == [first] and pb.FinishReason.Name(last.finish_reason) == "FINISH_REASON_STOP"
    _, r = post(port, COMPLETIONS, _j(prompt=PROMPT, max_tokens=12, temperature=0, stop_token_ids=[first]))
    assert r["usage"]["completion_tokens"] == 1 and r["choices"][0]["finish_reason"] == "stop"
    # min_tokens: the stop token cannot be sampled before N outputs.
    ids, _, last = grpc_ids(web, pb.GenerateRequest(
        text=PROMPT, sampling=greedy(12, stop_token_ids=[first], min_tokens=4)))
    assert len(ids) >= 4 and first not in ids[:4]
    _, r = post(port, COMPLETIONS, _j(prompt=PROMPT, max_tokens=12, temperature=0, stop_token_ids=[first],
                                      min_tokens=4))
    assert r["usage"]["completion_tokens"] == len(ids)
    # ignore_eos: an EOS as a stop would end at once; with ignore_eos exactly max_tokens.
    eos = sorted(web.engines[0].eos_token_ids)
    ids, _, last = grpc_ids(web, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[*web.engines[0].encode(PROMPT)]),
                                                    sampling=greedy(7, ignore_eos=True)))
    assert len(ids) == 7 and pb.FinishReason.Name(last.finish_reason) == "FINISH_REASON_LENGTH" and eos
    chat = _j(messages=[{"role": "user", "content": "Hi!"}], max_tokens=40, temperature=0)
    _, plain = post(port, CHAT, chat)
    _, forced = post(port, CHAT, chat[:-1] + b', "ignore_eos": true}')
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 40
    assert forced["usage"]["completion_tokens"] == 40 and forced["choices"][0]["finish_reason"] == "length"
    # include_stop_str_in_output keeps the stop string; without it the text ends before it.
    stop = base_text.strip().split()[1]
    _, cut = post(port, COMPLETIONS, _j(prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]))
    _, kept = post(port, COMPLETIONS, _j(prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                         include_stop_str_in_output=True))
    assert kept["choices"][0]["text"] == cut["choices"][0]["text"] + stop
    assert kept["choices"][0]["text"].endswith(stop) and stop not in cut["choices"][0]["text"]
    # truncate_prompt_tokens keeps the last N prompt tokens.
    _, r = post(port, COMPLETIONS, _j(prompt=PROMPT, max_tokens=2, temperature=0, truncate_prompt_tokens=3))
    tail = web.engines[0].encode(PROMPT)[-3:]
    _, want = post(port, COMPLETIONS, _j(prompt=tail, max_tokens=2, temperature=0))
    assert r["usage"]["prompt_tokens"] == 3 and r["choices"][0]["text"] == want["choices"][0]["text"]
    # add_special_tokens false vs true on completions: the token count differs iff the
    # tokenizer adds any (SmolLM2 adds none): both are 200 and agree with the tokenizer.
    for add in (False, True):
        _, r = post(port, COMPLETIONS, _j(prompt=PROMPT, max_tokens=1, temperature=0, add_special_tokens=add))
        assert r["usage"]["prompt_tokens"] == len(web.router.core.tokenizer.encode(PROMPT, add_special_tokens=add))


@pytest.mark.server
def test_continuous_usage_stats_in_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6
    assert len({c.usage.prompt_tokens for c in chunks if c.usage is not None}) == 1


@pytest.mark.server
def test_openai_sdk_extra_body_and_unknown_fields(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
             "stop_token_ids": [2], "skip_special_tokens": True, "spaces_between_special_tokens": True,
             "include_stop_str_in_output": False, "priority": 0, "cache_salt": "tenant-a",
             "truncate_prompt_tokens": 50, "frobnicate": {"x": 1}}
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, seed=7, temperature=0.8,
                                  extra_body=extra | {"add_special_tokens": True})
    assert r.usage is not None and r.usage.completion_tokens == 5
    again = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=5, seed=7, temperature=0.8,
                                      extra_body=extra | {"add_special_tokens": True})
    assert again.choices[0].text == r.choices[0].text  # seeded
    c = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4,  # type: ignore[arg-type]
                                       extra_body=extra)
    assert c.usage is not None and c.usage.completion_tokens == 4


ISSUE_BODIES = [  # requests as load tools send them: all 200
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}),
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": False}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True, "stream": True}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": False}),
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "stream": True,
                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 4, "min_tokens": 2, "top_k": 10, "min_p": 0.1,
                   "repetition_penalty": 1.2, "stop_token_ids": [0], "add_special_tokens": True}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "min_tokens": 2, "top_k": 10,
            "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [0]}),
]


@pytest.mark.server
@pytest.mark.parametrize("i", range(len(ISSUE_BODIES)))
def test_issue_bodies_replay_200(web: Cluster, i: int) -> None:
    path, body = ISSUE_BODIES[i]
    req = urllib.request.Request(f"http://127.0.0.1:{web.http_port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        raw = r.read()
    assert b'"error"' not in raw


def get(port: int, path: str) -> tuple[int, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
        return r.status, json.loads(r.read())


@pytest.mark.server
def test_utility_endpoints_tokenize_detokenize_version_models(web: Cluster) -> None:
    port, tok = web.http_port or 0, web.router.core.tokenizer
    status, r = post(port, "/tokenize", json.dumps({"model": "smollm2", "prompt": PROMPT}).encode())
    want = tok.encode(PROMPT)
    assert status == 200 and r["tokens"] == want and r["count"] == len(want)
    assert r["max_model_len"] == web.router.core.model_info.max_model_len and r["token_strs"] is None
    status, r = post(port, "/tokenize", json.dumps({"messages": MESSAGES}).encode())
    assert status == 200 and r["tokens"] == tok.apply_chat_template(MESSAGES)
    # The ids /tokenize returns are the ids a generation counts.
    _, gen = post(port, CHAT, _j(messages=MESSAGES, max_tokens=1, temperature=0))
    assert gen["usage"]["prompt_tokens"] == r["count"]
    status, d = post(port, "/detokenize", json.dumps({"tokens": want}).encode())
    assert status == 200 and d["prompt"] == tok.decode(want) == PROMPT
    assert post(port, "/detokenize", json.dumps({"tokens": [10**7]}).encode())[0] == 400
    assert post(port, "/tokenize", json.dumps({"prompt": 5}).encode())[0] == 400
    status, v = get(port, "/version")
    assert status == 200 and isinstance(v["version"], str) and v["version"]
    _, models = get(port, "/v1/models")
    assert models["data"][0]["max_model_len"] == web.router.core.model_info.max_model_len


@pytest.mark.server
def test_default_temperature_from_generation_config(web: Cluster, tmp_path: Path) -> None:
    from router.fronts.openai.vllm_fields import generation_default_temperature, read_default_temperature
    cfg = tmp_path / "generation_config.json"
    assert read_default_temperature(cfg) == 1.0  # no file
    cfg.write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    assert read_default_temperature(cfg) == 0.6
    cfg.write_text(json.dumps({"eos_token_id": 2}))
    assert read_default_temperature(cfg) == 1.0
    cfg.write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        read_default_temperature(cfg)
    # SmolLM2's generation_config.json names no temperature: the front's default is 1.0.
    assert generation_default_temperature(str(web.model_dir)) == 1.0
    assert web.router._http is not None and web.router._http.default_temperature == 1.0
