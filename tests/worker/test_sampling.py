"""Sampling: parameter validation, HF logits processors as oracles, seeded draws, stops."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.engine.sampling import (
    Sampler,
    SamplingHistory,
    SamplingParams,
    SamplingParamsError,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    check_stop_token,
    find_stop,
    find_stop_end,
    make_generator,
)

V = 64


def _logits(batch: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


def _history(prompt: list[int], output: list[int]) -> SamplingHistory:
    h = SamplingHistory(prompt)
    for t in output:
        h.append(t)
    return h


def _random_history(seed: int, vocab: int = V) -> SamplingHistory:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (12,), generator=g).tolist()
    output = torch.randint(0, vocab, (20,), generator=g).tolist()
    return _history(prompt, output)


def _survivors(x: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in x]


# ---------------------------------------------------------------- validation

BAD_VALUES = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.nan),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
    ("frequency_penalty", -3.0), ("frequency_penalty", 2.01), ("frequency_penalty", math.nan),
    ("stop", [""]), ("stop", ("ok", "")), ("stop", [3]), ("stop", ""),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value_raises_naming_field(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError, match=rf"^{field} must be ") as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_good_edges_accepted_and_lists_normalised() -> None:
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, seed=-1,
                       presence_penalty=-2.0, frequency_penalty=2.0, stop=["a", "bc"],
                       stop_token_ids=[5, 7])
    assert p.stop == ("a", "bc") and p.stop_token_ids == (5, 7)
    assert SamplingParams(stop="END").stop == ("END",)
    assert hash(p) == hash(SamplingParams(**{f: getattr(p, f) for f in p.__slots__}))
    assert not SamplingParams(top_k=-1).top_k_enabled and SamplingParams(top_k=1).top_k_enabled


def test_is_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().is_greedy


def test_history_counts_match_counter() -> None:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 20, (15,), generator=g).tolist()
    output = torch.randint(0, 20, (40,), generator=g).tolist()
    h = _history(prompt, output)
    assert h.output_counts == dict(Counter(output))
    assert h.seen_token_ids == set(prompt) | set(output)
    assert h.num_output_tokens == 40 and h.prompt_token_ids == tuple(prompt)


# ---------------------------------------------------------------- greedy

def _penalised_oracle(logits: torch.Tensor, p: SamplingParams, h: SamplingHistory) -> torch.Tensor:
    row = logits.clone()
    for t in set(list(h.prompt_token_ids) + h.output_token_ids):
        v = float(row[t])
        row[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t, c in Counter(h.output_token_ids).items():
        row[t] -= p.presence_penalty * (c > 0) + p.frequency_penalty * c
    return row


def test_greedy_is_argmax_of_penalised_logits() -> None:
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=-0.8, repetition_penalty=0.6),
        SamplingParams(temperature=0.0, presence_penalty=-2.0, frequency_penalty=2.0),
        SamplingParams(temperature=0.0),
    ]
    for trial in range(10):
        logits = _logits(len(params), seed=trial, scale=1.0)
        hists = [_random_history(100 * trial + i) for i in range(len(params))]
        before = logits.clone()
        got = Sampler()(logits, params, hists, [None] * len(params))
        want = torch.stack([_penalised_oracle(logits[i], params[i], hists[i]).argmax()
                            for i in range(len(params))])
        assert torch.equal(got, want)
        assert got.dtype == torch.int64 and got.shape == (len(params),)
        assert torch.equal(logits, before), "caller's logits must not change"


def test_greedy_ties_pick_lowest_index_and_mixed_batch_greedy_rows_exact() -> None:
    logits = torch.zeros(3, 10)
    logits[:, [4, 7]] = 5.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, presence_penalty=0.1)]
    hists = [_history([], []), _history([], []), _history([], [4])]
    got = Sampler()(logits, params, hists, [None, make_generator(1, "cpu"), None])
    assert got[0] == 4 and got[1] in (4, 7) and got[2] == 7


def test_greedy_fast_path_matches_argmax() -> None:
    logits = _logits(6, seed=9)
    params = [SamplingParams(temperature=0.0)] * 6
    got = Sampler()(logits, params, [_history([1], [])] * 6, [None] * 6)
    assert torch.equal(got, logits.argmax(dim=1))


def test_history_ids_outside_vocab_are_ignored() -> None:
    logits = _logits(1, seed=2)
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)
    h = _history([V + 5, 3], [V + 100, 3])
    out = logits.clone()
    apply_penalties(out, [p], [h])
    ref = _penalised_oracle(logits[0], p, _history([3], [3]))
    torch.testing.assert_close(out[0], ref)


# ---------------------------------------------------------------- HF oracles

@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty: float) -> None:
    logits = _logits(4, seed=11)
    hists = [_random_history(20 + i) for i in range(4)]
    params = [SamplingParams(repetition_penalty=penalty)] * 4
    got = logits.clone()
    apply_penalties(got, params, hists)
    for i, h in enumerate(hists):
        ids = torch.tensor([list(h.prompt_token_ids) + h.output_token_ids])
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)


def test_temperature_matches_hf() -> None:
    temps = [0.05, 0.7, 1.0, 2.5]
    logits = _logits(len(temps), seed=12)
    got = logits.clone()
    apply_temperature(got, temps)
    for i, t in enumerate(temps):
        want = TemperatureLogitsWarper(t)(None, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)


@pytest.mark.parametrize("k", [1, 2, 5, V - 1, V, V + 3])
def test_top_k_matches_hf(k: int) -> None:
    logits = _logits(5, seed=13)
    logits[0, :3] = logits[0].max()  # a tie at the top: HF keeps every tied token
    got = logits.clone()
    apply_top_k_top_p(got, [k] * 5, [1.0] * 5)
    want = TopKLogitsWarper(k)(None, logits.clone())
    assert _survivors(got) == _survivors(want)


@pytest.mark.parametrize("p", [0.01, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_top_p_matches_hf(p: float) -> None:
    logits = _logits(5, seed=14)
    got = logits.clone()
    apply_top_k_top_p(got, [0] * 5, [p] * 5)
    want = TopPLogitsWarper(p)(None, logits.clone())
    assert _survivors(got) == _survivors(want)
    assert all(len(s) >= 1 for s in _survivors(got))


def test_mixed_top_k_top_p_rows_match_hf_chain() -> None:
    ks = [0, 3, 10, -1, 1, 40]
    ps = [0.8, 1.0, 0.6, 1.0, 0.5, 0.95]
    logits = _logits(len(ks), seed=15)
    got = logits.clone()
    apply_top_k_top_p(got, ks, ps)
    for i, (k, p) in enumerate(zip(ks, ps)):
        want = logits[i:i + 1].clone()
        if k > 0:
            want = TopKLogitsWarper(k)(None, want)
        want = TopPLogitsWarper(p)(None, want)
        assert _survivors(got[i:i + 1]) == _survivors(want), (k, p)


def test_top_k_only_mixed_rows_match_hf() -> None:
    ks = [0, 3, 17, -1]
    logits = _logits(len(ks), seed=16)
    got = logits.clone()
    apply_top_k_top_p(got, ks, [1.0] * len(ks))
    for i, k in enumerate(ks):
        want = TopKLogitsWarper(k)(None, logits[i:i + 1].clone()) if k > 0 else logits[i:i + 1]
        assert _survivors(got[i:i + 1]) == _survivors(want)


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_hf(min_p: float) -> None:
    logits = _logits(5, seed=17, scale=2.0)
    probs = logits.softmax(dim=1)
    assert bool((probs > 0).all())
    apply_min_p(probs, [min_p] * 5)
    want = MinPLogitsWarper(min_p)(None, logits.clone()) if min_p > 0 else logits
    assert [set(torch.nonzero(r > 0).flatten().tolist()) for r in probs] == _survivors(want)


def test_sampled_tokens_lie_in_hf_chain_support() -> None:
    p = SamplingParams(temperature=0.7, top_k=12, top_p=0.8, min_p=0.05, repetition_penalty=1.2)
    h = _random_history(5)
    base = _logits(1, seed=18)
    n = 400
    got = Sampler()(base.expand(n, V), [p] * n, [h] * n,
                    [make_generator(i, "cpu") for i in range(n)])
    scores = base.clone()
    ids = torch.tensor([list(h.prompt_token_ids) + h.output_token_ids])
    for proc in (RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7),
                 TopKLogitsWarper(12), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        scores = proc(ids, scores)
    support = _survivors(scores)[0]
    assert set(got.tolist()) <= support
    assert len(set(got.tolist())) > 1  # it really samples


# ---------------------------------------------------------------- seeds & statistics

def test_seeded_row_reproducible_across_batch_compositions() -> None:
    target = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=123)
    others = [SamplingParams(temperature=0.0, presence_penalty=0.5),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.3, top_k=5, frequency_penalty=0.4, seed=7)]
    sampler = Sampler()
    gen_alone = make_generator(123, "cpu")
    gen_batch = make_generator(123, "cpu")
    h_alone, h_batch = _history([1, 2, 3], []), _history([1, 2, 3], [])
    other_hists = [_history([4], []) for _ in others]
    batch_params = [others[0], others[1], target, others[2]]
    batch_gens = [None, None, gen_batch, make_generator(7, "cpu")]
    for step in range(30):
        logits = _logits(4, seed=1000 + step, scale=1.5)
        alone = sampler(logits[2:3], [target], [h_alone], [gen_alone])
        batch = sampler(logits, batch_params, [other_hists[0], other_hists[1], h_batch,
                                               other_hists[2]], batch_gens)
        assert int(alone[0]) == int(batch[2]), step
        h_alone.append(int(alone[0]))
        h_batch.append(int(batch[2]))
        for j, hist in zip((0, 1, 3), other_hists):
            hist.append(int(batch[j]))
    assert len(set(h_alone.output_token_ids)) > 1


def test_same_seed_same_tokens_and_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    g = make_generator(42, torch.device("cpu"))
    assert g is not None and g.initial_seed() == 42
    p = SamplingParams(temperature=1.0, seed=42)
    logits = _logits(1, seed=19).expand(2, V)
    draws = [Sampler()(logits, [p, p], [_history([], [])] * 2,
                       [make_generator(42, "cpu"), make_generator(42, "cpu")]) for _ in range(2)]
    assert draws[0][0] == draws[0][1] == draws[1][0]


def _two_token_logits(n: int) -> torch.Tensor:
    probs = torch.tensor([0.01, 0.02, 0.05, 0.56, 0.03, 0.24, 0.04, 0.05])  # top-2 → 0.7 / 0.3
    return probs.log().expand(n, -1)


def test_top_k_two_token_frequencies_seeded() -> None:
    n = 2000
    p = SamplingParams(top_k=2)
    got = Sampler()(_two_token_logits(n), [p] * n, [_history([], [])] * n,
                    [make_generator(10_000 + i, "cpu") for i in range(n)])
    counts = Counter(got.tolist())
    assert set(counts) <= {3, 5}
    assert abs(counts[3] / n - 0.7) < 0.04  # ~4 sigma


def test_top_k_two_token_frequencies_global_rng() -> None:
    n = 2000
    p = SamplingParams(top_k=2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        got = Sampler()(_two_token_logits(n), [p] * n, [_history([], [])] * n, [None] * n)
    counts = Counter(got.tolist())
    assert set(counts) <= {3, 5}
    assert abs(counts[3] / n - 0.7) < 0.04


# ---------------------------------------------------------------- stops

def test_find_stop_edges() -> None:
    assert find_stop("hello world!", 9, ["world"]) == 6  # spans old "wor" + new "ld!"
    assert find_stop("a STOP b", 7, ["STOP"]) is None  # wholly in old text: already seen
    assert find_stop("xx END yy STOP", 0, ["STOP", "END"]) == 3  # earliest wins
    assert find_stop("zabc", 0, ["abc", "ab"]) == 1
    assert find_stop_end("zabc", 0, ["abc", "ab"]) == 3  # tie on start → the one ending first
    assert find_stop_end("hello world!", 9, ["world"]) == 11
    assert find_stop("abc", 3, ["c"]) is None  # no new text
    assert find_stop("ab", 0, ["abc"]) is None
    assert find_stop("abc", 0, []) is None
    assert find_stop("abcabc", 4, ["abc"]) == 3  # the later, new occurrence


@settings(max_examples=200, deadline=None)
@given(text=st.text("ab\n", max_size=12), cut=st.integers(0, 12),
       stops=st.lists(st.text("ab\n", min_size=1, max_size=3), max_size=3))
def test_find_stop_matches_brute_force(text: str, cut: int, stops: list[str]) -> None:
    cut = min(cut, len(text))
    spans = [(i, i + len(s)) for s in stops for i in range(len(text))
             if text.startswith(s, i) and i + len(s) > cut]
    want = min(spans) if spans else None
    assert find_stop(text, cut, stops) == (want[0] if want else None)
    assert find_stop_end(text, cut, stops) == (want[1] if want else None)


def test_check_stop_token() -> None:
    eos = {2, 0}
    p = SamplingParams(max_tokens=5, stop_token_ids=[9])
    assert check_stop_token(2, 1, p, eos) == "stop"
    assert check_stop_token(9, 1, p, eos) == "stop"
    assert check_stop_token(4, 4, p, eos) is None
    assert check_stop_token(4, 5, p, eos) == "length"
    assert check_stop_token(2, 5, p, eos) == "stop"  # the token's own reason wins
    ig = SamplingParams(max_tokens=5, stop_token_ids=[9], ignore_eos=True)
    assert check_stop_token(2, 1, ig, eos) is None
    assert check_stop_token(2, 5, ig, eos) == "length"
    assert check_stop_token(9, 1, ig, eos) == "stop"  # stop_token_ids still stop
    assert check_stop_token(7, 1, SamplingParams(), []) is None
