"""Resuming a request (`resume_tokens`, what request migration sends to the new worker): the
client's view (tokens, text joined across the seam, usage, stop strings spanning the seam,
penalties, seeded sampling) equals one uninterrupted run. SmolLM2, its real tokenizer."""
from __future__ import annotations

import dataclasses

import pytest

from worker.engine.engine import Engine, EngineConfig
from worker.engine.request import InvalidRequest, prompt_input
from worker.engine.sampling import SamplingParams

PROMPT = "Write a short story about a robot who learns to paint. Once upon a time,"


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return Engine(EngineConfig(model=str(smollm2_dir), num_blocks=128))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir("llama-gqa")), block_size=4, num_blocks=128,
                               check_integrity=True, max_model_len=64))


def _stream(engine: Engine, ids: list[int], params: SamplingParams, resume: int = 0) -> tuple[list[int], str, object]:
    """Run one request to the end: (new token ids, new text, the final output)."""
    rid = engine.add_request(prompt_input(ids, params, resume_tokens=resume))
    tokens: list[int] = []
    text = ""
    while True:
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            text += out.new_text
            if out.finished:
                return tokens, text, out


def _migrated(engine: Engine, ids: list[int], params: SamplingParams, cut: int) -> tuple[list[int], str, object]:
    """What a client sees when its worker died after `cut` tokens: the first worker's first
    `cut` tokens and their text, then the resumed run's."""
    first = dataclasses.replace(params, max_tokens=cut, min_tokens=min(params.min_tokens, cut), stop=())
    head, head_text, _ = _stream(engine, ids, first)
    tail, tail_text, final = _stream(engine, ids + head, params, resume=len(head))
    return head + tail, head_text + tail_text, final


@pytest.mark.parametrize("name,params", [
    ("greedy", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
    ("seeded", SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)),
    ("penalties", SamplingParams(max_tokens=16, temperature=0.8, seed=7, frequency_penalty=1.5,
                                 presence_penalty=0.5, repetition_penalty=1.3, min_tokens=12)),
])
def test_resumed_tokens_equal_an_uninterrupted_run(tiny: Engine, name: str, params: SamplingParams) -> None:
    """Tokens, usage and finish reason (tiny model: no tokenizer); seeded sampling included."""
    ids = [5, 6, 7, 8, 9, 10, 11]
    whole, _, whole_final = _stream(tiny, ids, params)
    for cut in (1, 6, 11):
        tokens, _, final = _migrated(tiny, ids, params, cut)
        assert tokens == whole, (name, cut)
        assert (final.prompt_tokens, final.completion_tokens) == (len(ids), len(whole)), (name, cut)
        assert final.finish_reason == whole_final.finish_reason


def test_text_joins_at_the_seam_and_a_stop_string_spanning_it_still_stops(smol: Engine) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = smol.encode(PROMPT)
    whole, whole_text, _ = _stream(smol, ids, params)
    cut = 5
    tokens, text, final = _migrated(smol, ids, params, cut)
    assert tokens == whole and text == whole_text
    assert (final.prompt_tokens, final.completion_tokens) == (len(ids), 10)

    seam = len(smol.tokenizer.decode(whole[:cut]))
    stop = whole_text[seam - 3:seam + 3]     # 3 characters either side of the seam
    assert len(stop.strip()) >= 4 and whole_text.find(stop) == seam - 3, (stop, whole_text)
    with_stop = dataclasses.replace(params, stop=(stop,))
    expected_tokens, expected_text, expected = _stream(smol, ids, with_stop)
    # (this engine streams text without holding back a possible stop-string prefix: the
    # client has seen the stop's first characters when the stop completes, whether or not
    # the request moved; the final text ends before the stop)
    assert expected.finish_reason == "stop" and expected.text == whole_text[:seam - 3]
    tokens, text, final = _migrated(smol, ids, with_stop, cut)
    assert final.finish_reason == "stop" and tokens == expected_tokens
    assert text == expected_text and final.text == expected.text


def test_bad_resume_is_refused(smol: Engine) -> None:
    ids = smol.encode(PROMPT)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for resume in (len(ids), -1):
        with pytest.raises(InvalidRequest, match="resume_tokens"):
            smol.add_request(prompt_input(ids, params, resume_tokens=resume))
    with pytest.raises(InvalidRequest, match="fewer than max_tokens"):
        smol.add_request(prompt_input(ids, params, resume_tokens=4))
