"""The attention backend choice, the Triton backend inside the model and the engine, and the
decode CUDA-graph runner (its padding on any device; its capture on CUDA, marked `gpu`).

Without CUDA the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before any
kernel is defined); tiny random models keep that fast.
"""
from __future__ import annotations

import os

import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="Triton is installed by `make setup` (Linux only)")

from worker.kernels import native  # noqa: E402
from worker.kernels.backend import AttentionBackend, attention_ops, parse_backend, resolve_backend  # noqa: E402
from worker.kernels.reference import AttnMetadata  # noqa: E402
from worker.model.cuda_graph import StaticDecode, bucket_for, capture_sizes  # noqa: E402
from worker.model.llama import LlamaModel  # noqa: E402
from worker.model.loader import load_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def needs_triton_device(test):  # type: ignore[no-untyped-def]
    """Runs where Triton can: the interpreter on CPU, compiled on CUDA (then marked `gpu`)."""
    test = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                              reason="TRITON_INTERPRET=0 and no CUDA: Triton cannot run")(test)
    return pytest.mark.gpu(test) if DEVICE.type == "cuda" else test


# -- backend choice -------------------------------------------------------------------------
def test_parse_backend_names_the_accepted_values() -> None:
    assert parse_backend("triton") is AttentionBackend.TRITON
    with pytest.raises(ValueError, match="attention_backend='cuda'; accepted: auto, torch, native, triton"):
        parse_backend("cuda")


def test_auto_resolves_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = AttentionBackend.NATIVE if native.load() is not None else AttentionBackend.TORCH
    assert resolve_backend("auto", torch.device("cpu")) is cpu
    assert resolve_backend("auto", torch.device("cuda")) is AttentionBackend.TRITON  # triton is installed
    monkeypatch.setattr(native, "load", lambda: None)
    assert resolve_backend("auto", torch.device("cpu")) is AttentionBackend.TORCH
    with pytest.raises(ValueError, match="native CPU kernels are not built"):
        resolve_backend("native", torch.device("cpu"))


def test_explicit_backends_that_cannot_run_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend("torch", torch.device("cuda")) is AttentionBackend.TORCH
    with pytest.raises(ValueError, match="native is the CPU kernel"):
        resolve_backend("native", torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.device("cpu")) is AttentionBackend.TRITON


def test_engine_config_validates_the_backend_name() -> None:
    from worker.engine.config import EngineConfig
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    assert EngineConfig(attention_backend="torch", enforce_eager=True).enforce_eager


# -- the model on the Triton backend --------------------------------------------------------
def _models(tiny_model_dir, kind: str) -> tuple[LlamaModel, LlamaModel]:  # type: ignore[no-untyped-def]
    loaded = load_weights(tiny_model_dir(kind), dtype=torch.float32, device=DEVICE)
    return (LlamaModel(loaded.config, loaded.weights, attention_ops(AttentionBackend.TRITON)),
            LlamaModel(loaded.config, loaded.weights, attention_ops(AttentionBackend.TORCH)))


def _caches(model: LlamaModel, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg = model.cfg
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)) for _ in range(cfg.num_layers)]


@needs_triton_device
@pytest.mark.parametrize("kind", ["llama-gqa", "mistral-swa"])
def test_model_steps_match_the_torch_backend(tiny_model_dir, kind: str) -> None:
    """A packed prefill (a fresh prompt and a chunk over a cached prefix) and two decode steps:
    the Triton backend's logits equal the torch backend's (window 8 for mistral-swa)."""
    triton_model, torch_model = _models(tiny_model_dir, kind)
    block_size = 4
    caches = {m: _caches(m, 16, block_size) for m in (triton_model, torch_model)}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (40,), generator=gen).to(DEVICE)
    tables = [[3, 0, 7, 1, 12], [5, 9, 2, 14, 6, 10]]

    def step(q_lens: list[int], seq_lens: list[int], rows: list[torch.Tensor]) -> None:
        meta = AttnMetadata.build(q_lens, seq_lens, tables, block_size, DEVICE)
        positions = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens)]).to(DEVICE)
        tokens = torch.cat(rows)
        out = {m: m.forward(tokens, positions, caches[m], meta) for m in caches}
        torch.testing.assert_close(out[triton_model], out[torch_model], atol=1e-4, rtol=1e-4)

    step([9, 11], [9, 11], [ids[:9], ids[20:31]])
    step([5, 10], [14, 21], [ids[9:14], ids[30:40]])  # chunks over the cached prefixes
    step([1, 1], [15, 22], [ids[14:15], ids[15:16]])
    step([1, 1], [16, 23], [ids[16:17], ids[17:18]])


@needs_triton_device
def test_static_decode_pads_to_its_bucket(tiny_model_dir) -> None:
    """A decode step of 3 sequences run through a size-4 StaticDecode (what a CUDA graph
    captures: lengths from tensors, splits planned for max_model_len, a padded row with
    slot -1) gives the eager step's logits and writes the same K/V, and nothing else."""
    model, _ = _models(tiny_model_dir, "llama-gqa")
    block_size, max_model_len = 4, 64
    eager, padded = _caches(model, 24, block_size), _caches(model, 24, block_size)
    tables = [[4, 1, 9], [0, 2], [7, 3, 5, 8, 11]]
    lens = [9, 6, 17]
    gen = torch.Generator().manual_seed(1)
    prefill = AttnMetadata.build(lens, lens, tables, block_size, DEVICE)
    ids = torch.randint(3, 250, (sum(lens),), generator=gen).to(DEVICE)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    for caches in (eager, padded):
        model.forward(ids, positions, caches, prefill)
    meta = AttnMetadata.build([1, 1, 1], [n + 1 for n in lens], tables, block_size, DEVICE)
    new_ids = torch.tensor([17, 42, 99], device=DEVICE)
    new_pos = torch.tensor(lens, device=DEVICE)
    want = model.forward(new_ids, new_pos, eager, meta)
    static = StaticDecode(model, padded, 4, max_model_len, block_size)
    assert static.meta.seq_lens_list == [max_model_len] * 4
    static.load(new_ids, new_pos, meta)
    assert static.meta.slot_mapping[3].item() == -1 and static.meta.seq_lens[3].item() == 1
    got = static.forward()
    assert got.shape[0] == 4
    torch.testing.assert_close(got[:3], want, atol=1e-4, rtol=1e-4)
    for (ek, ev), (pk, pv) in zip(eager, padded):
        torch.testing.assert_close(pk, ek, atol=1e-5, rtol=1e-5)  # the padded row wrote nothing
        torch.testing.assert_close(pv, ev, atol=1e-5, rtol=1e-5)


def test_capture_sizes_and_buckets() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    sizes = capture_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 16, 17, 33, 48, 49)] == [1, 2, 4, 8, 16, 32, 48, 48, None]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


# -- the engine -----------------------------------------------------------------------------
@needs_triton_device
def test_engine_decodes_through_padded_buckets(tiny_model_dir) -> None:
    """The engine's graph path without the capture (`capture=False`): every decode step goes
    through a padded bucket's static buffers (batches of 3, 2 and 1 in buckets of 4, 2, 1 as
    requests finish) and generates the eager engine's tokens."""
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sampling import SamplingParams
    from worker.model.cuda_graph import CudaGraphRunner

    path = str(tiny_model_dir("llama-gqa"))
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [100, 101, 102, 103, 104, 105, 106]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5, 7)]
    outs = {}
    for padded in (True, False):
        engine = Engine(EngineConfig(model=path, device=DEVICE.type, dtype="fp32", block_size=4, num_blocks=64,
                                     max_num_seqs=4, attention_backend="triton", enforce_eager=True))
        if padded:
            engine.runner.cuda_graphs = CudaGraphRunner(engine.runner.model, engine.runner.kv_caches, 4,
                                                        engine.max_model_len, 4, capture=False)
        outs[padded] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs[True] == outs[False]


@needs_triton_device
def test_engine_on_the_triton_backend_generates_the_torch_tokens(tiny_model_dir) -> None:
    """Greedy generation (prefill, prefix hit, decode) on the Triton backend equals the torch
    backend's, token for token; on CUDA the Triton engine also replays its decode graphs."""
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sampling import SamplingParams

    path = str(tiny_model_dir("llama-gqa"))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42], [100, 101, 102]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        engine = Engine(EngineConfig(model=path, device=DEVICE.type, dtype="fp32", block_size=4, num_blocks=64,
                                     max_num_seqs=4, attention_backend=backend))
        assert engine.runner.attention_backend is AttentionBackend(backend)
        assert (engine.runner.cuda_graphs is not None) == (backend == "triton" and DEVICE.type == "cuda")
        outs[backend] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_cuda_graph_decode_equals_eager(tiny_model_dir, kv_dtype: str) -> None:
    """On CUDA: the engine with captured decode graphs generates what --enforce-eager does."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need CUDA")
    from worker.engine.engine import Engine, EngineConfig
    from worker.engine.sampling import SamplingParams

    path = str(tiny_model_dir("llama-gqa"))
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        engine = Engine(EngineConfig(model=path, device="cuda", dtype="fp32", kv_cache_dtype=kv_dtype,
                                     block_size=16, num_blocks=64, max_num_seqs=8, enforce_eager=eager))
        assert (engine.runner.cuda_graphs is None) == eager
        outs[eager] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs[False] == outs[True]
