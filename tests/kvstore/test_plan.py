"""`kvmesh plan`: the primer's figures, presets vs real HF config.json files, bad input."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.plan import add_arguments, main, render_table
from kvstore.layout import KVLayout
from kvstore.plan import PRESETS, ModelShape, PlanError, load_model_shape, make_plan, parse_lengths

GIB = 1 << 30
LLAMA_7B_PARAMS = 6_738_415_616

# Published parameter counts (HF model cards / safetensors index totals).
PUBLISHED_PARAMS = {
    "llama-7b": LLAMA_7B_PARAMS,
    "llama-2-7b": LLAMA_7B_PARAMS,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2-7b": 7_615_616_512,
    "smollm2-135m": 134_515_008,
}

# config.json files as published on the HF hub (abridged only of tokenizer/init fields).
HF_CONFIGS = {
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32000},
    "qwen2-7b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": 3584, "intermediate_size": 18944, "max_position_embeddings": 131072,
        "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 152064},
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "is_llama_config": True,
        "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 100000,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 49152},
    "llama-2-70b": {
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 8192,
        "intermediate_size": 28672, "max_position_embeddings": 4096, "model_type": "llama",
        "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 32000},
    "llama-7b": {  # huggyllama/llama-7b: no num_key_value_heads (MHA), no head_dim
        "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 11008, "max_position_embeddings": 2048, "max_sequence_length": 2048,
        "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "pad_token_id": 0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
        "torch_dtype": "float16", "vocab_size": 32000},
}


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvmesh plan")
    add_arguments(parser)
    return main(parser.parse_args(argv))


# --- the primer's numbers ------------------------------------------------------------------

def test_llama_7b_primer_figures() -> None:
    plan = make_plan(PRESETS["llama-7b"], context=4096, batch=32, kv_cache_dtype="fp16")
    assert plan.bytes_per_token == 524288 == 512 * 1024  # 2 × 32 × 32 × 128 × 2
    assert plan.bytes_per_sequence == 2147483648 == 2 * GIB
    assert plan.bytes_total == 64 * GIB
    assert plan.blocks_per_sequence == 256
    assert plan.max_sequences is None and plan.fits is None and plan.kv_budget_bytes is None


def test_llama_2_70b_gqa_is_eight_times_smaller_than_mha() -> None:
    plan = make_plan(PRESETS["llama-2-70b"], kv_cache_dtype="fp16")
    assert plan.bytes_per_token == 327680 == 320 * 1024
    variants = {v.name: v for v in plan.attention_variants}
    assert [(v.name, v.num_key_value_heads, v.is_model) for v in plan.attention_variants] == [
        ("mha", 64, False), ("gqa", 8, True), ("mqa", 1, False)]
    assert variants["mha"].bytes_per_token == 8 * variants["gqa"].bytes_per_token
    assert variants["gqa"].bytes_per_token == 8 * variants["mqa"].bytes_per_token
    assert variants["gqa"].bytes_per_sequence == plan.bytes_per_sequence


def test_mha_model_has_no_separate_gqa_row() -> None:
    plan = make_plan(PRESETS["llama-7b"])
    assert [(v.name, v.is_model) for v in plan.attention_variants] == [
        ("mha", True), ("mqa", False)]


# --- parameters and weights ---------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_count_matches_published(name: str) -> None:
    assert PRESETS[name].num_params == PUBLISHED_PARAMS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_count_matches_transformers(name: str) -> None:
    """Oracle: HF transformers builds the model on the meta device and counts."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    shape = PRESETS[name]
    arch = "Qwen2" if name.startswith("qwen2") else "Mistral" if name.startswith("mistral") \
        else "Llama"
    config = getattr(transformers, f"{arch}Config")(
        num_hidden_layers=shape.num_hidden_layers, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings)
    with torch.device("meta"):
        model = getattr(transformers, f"{arch}ForCausalLM")(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("dtype", "num", "den"), [
    ("fp32", 4, 1), ("fp16", 2, 1), ("bf16", 2, 1), ("int8", 1, 1), ("int4", 1, 2),
    ("q8_0", 17, 16), ("q4_0", 5, 8), ("q4_1", 5, 8)])
def test_weights_bytes_per_dtype(dtype: str, num: int, den: int) -> None:
    shape = PRESETS["smollm2-135m"]
    plan = make_plan(shape, weights_dtype=dtype)
    assert plan.weights_bytes == -(-shape.num_params * num // den)


@pytest.mark.parametrize(("weights", "kv"), [
    ("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"), ("int8", "fp16"), ("int4", "fp16"),
    ("q8_0", "fp32"), ("q4_1", "fp32")])
def test_auto_kv_dtype_is_compute_dtype(weights: str, kv: str) -> None:
    assert make_plan(PRESETS["llama-7b"], weights_dtype=weights).kv_cache_dtype == kv


def test_smaller_weights_free_kv_blocks_over_fp32() -> None:
    """The bytes q4_1 weights save over fp32 are counted as KV blocks, in the plan and its table."""
    shape = PRESETS["smollm2-135m"]
    fp32 = make_plan(shape, weights_dtype="fp32", kv_cache_dtype="fp32", gpu_memory_gib=1)
    q4 = make_plan(shape, weights_dtype="q4_1", kv_cache_dtype="fp32", gpu_memory_gib=1)
    assert fp32.extra_blocks_vs_fp32 == 0
    saved = fp32.weights_bytes - q4.weights_bytes
    assert q4.extra_blocks_vs_fp32 == saved // q4.bytes_per_block > 0
    assert q4.num_blocks is not None and fp32.num_blocks is not None
    assert q4.num_blocks - fp32.num_blocks in (q4.extra_blocks_vs_fp32, q4.extra_blocks_vs_fp32 + 1)
    assert f"+{q4.extra_blocks_vs_fp32:,}" in render_table(q4)


# --- budget, max_sequences, fits ----------------------------------------------------------

def test_llama_7b_on_80_gib() -> None:
    plan = make_plan(PRESETS["llama-7b"], context=4096, batch=32, kv_cache_dtype="fp16",
                     gpu_memory_gib=80)
    # By hand: 72 GiB usable − 2 × 6,738,415,616 B of weights = 59.45 GiB; 2 GiB per sequence.
    assert plan.weights_bytes == 2 * LLAMA_7B_PARAMS == 13_476_831_232
    assert plan.usable_bytes == 72 * GIB
    assert plan.kv_budget_bytes == 72 * GIB - 13_476_831_232 == 63_832_580_096
    assert plan.num_blocks == 63_832_580_096 // (8 << 20) == 7609
    assert plan.max_sequences == 29
    assert plan.fits is False
    text = render_table(plan)
    assert "DOES NOT FIT: needs 64.00 GiB of KV, 59.45 GiB available" in text


@pytest.mark.parametrize("batch", [1, 28, 29, 30, 32])
def test_fits_consistent_with_bytes(batch: int) -> None:
    plan = make_plan(PRESETS["llama-7b"], batch=batch, kv_cache_dtype="fp16", gpu_memory_gib=80)
    assert plan.kv_budget_bytes is not None and plan.max_sequences is not None
    assert plan.fits == (plan.bytes_total <= plan.kv_budget_bytes) == (batch <= 29)
    assert plan.max_sequences * plan.bytes_per_sequence <= plan.kv_budget_bytes
    assert (plan.max_sequences + 1) * plan.bytes_per_sequence > plan.kv_budget_bytes
    assert ("FITS:" in render_table(plan)) == plan.fits


def test_weights_larger_than_gpu() -> None:
    plan = make_plan(PRESETS["llama-2-70b"], gpu_memory_gib=80)  # 128 GiB of fp16 weights
    assert plan.kv_budget_bytes == 0 and plan.max_sequences == 0 and plan.fits is False
    assert any("exceed usable GPU memory" in w for w in plan.warnings)
    assert all(d.max_sequences == 0 for d in plan.per_dtype)


def test_context_beyond_max_position_warns() -> None:
    assert any("max_position_embeddings 2048" in w
               for w in make_plan(PRESETS["llama-7b"], context=4096).warnings)
    assert make_plan(PRESETS["llama-2-7b"], context=4096).warnings == ()


# --- per dtype, sliding window, waste -----------------------------------------------------

def test_per_dtype_rows_come_from_kv_layout() -> None:
    shape = PRESETS["llama-3-8b"]
    plan = make_plan(shape, context=8192, gpu_memory_gib=80, kv_cache_dtype="fp16")
    assert [d.kv_cache_dtype for d in plan.per_dtype] == ["fp16", "fp8", "int8", "int4"]
    budget = plan.kv_budget_bytes
    assert budget is not None
    for row in plan.per_dtype:
        layout = KVLayout(32, 8, 128, 16, row.kv_cache_dtype)
        assert row.bytes_per_token == layout.bytes_per_token
        assert row.bytes_per_sequence == layout.bytes_per_sequence(8192)
        assert row.max_sequences == layout.num_blocks_in(budget) // layout.blocks_for(8192)
    fp16, fp8, int8, int4 = plan.per_dtype
    assert fp16.bytes_per_token == plan.bytes_per_token
    # quantized rows pay for scales: a little more than half / a quarter of fp16
    assert fp16.bytes_per_token / 2 < int8.bytes_per_token == fp8.bytes_per_token
    assert fp16.bytes_per_token / 4 < int4.bytes_per_token < int8.bytes_per_token
    assert fp16.max_sequences is not None and int4.max_sequences is not None
    assert int4.max_sequences > fp16.max_sequences


def test_sliding_window_caps_mistral() -> None:
    plan = make_plan(PRESETS["mistral-7b"], context=32768, gpu_memory_gib=80)
    window = plan.sliding_window
    assert window is not None and window.window == 4096
    assert window.blocks_per_sequence_capped == 4096 // 16 + 1
    assert window.bytes_per_sequence_capped == 257 * plan.bytes_per_block
    assert window.bytes_per_sequence_uncapped == plan.bytes_per_sequence == 2048 * 2 * 1 << 20
    assert window.max_sequences_uncapped == plan.max_sequences
    assert window.max_sequences_capped == plan.num_blocks // 257
    short = make_plan(PRESETS["mistral-7b"], context=1000).sliding_window
    assert short is not None and short.bytes_per_sequence_capped == short.bytes_per_sequence_uncapped
    assert make_plan(PRESETS["llama-3-8b"]).sliding_window is None
    assert make_plan(PRESETS["qwen2-7b"]).sliding_window is None


def test_waste_by_hand() -> None:
    # smollm2 fp16: 2 × 30 × 3 × 64 × 2 = 23,040 B per token; block 16 → 368,640 B.
    plan = make_plan(PRESETS["smollm2-135m"], context=32, lengths=[1, 16, 17], gpu_memory_gib=1)
    waste = plan.waste
    assert plan.bytes_per_token == 23040
    assert (waste.num_lengths, waste.mean_length, waste.max_length) == (3, 34 / 3, 32)
    assert waste.paged_waste_fraction == (64 - 34) / 64  # 1 + 1 + 2 blocks of 16 slots
    assert waste.contiguous_waste_fraction == (96 - 34) / 96
    assert plan.kv_budget_bytes is not None and plan.num_blocks is not None
    assert waste.paged_sequences_admitted == plan.num_blocks * 3 // 4
    assert waste.contiguous_sequences_admitted == plan.kv_budget_bytes // (32 * 23040)


def test_default_waste_is_uniform_64_and_paged_beats_contiguous() -> None:
    plan = make_plan(PRESETS["llama-3-8b"], gpu_memory_gib=80)
    waste = plan.waste
    assert waste.lengths == "uniform:64" and waste.num_lengths == 64
    assert waste.paged_waste_fraction < 0.01 < 0.45 < waste.contiguous_waste_fraction
    assert waste.paged_sequences_admitted is not None
    assert waste.contiguous_sequences_admitted is not None
    assert waste.paged_sequences_admitted > 1.9 * waste.contiguous_sequences_admitted


@pytest.mark.parametrize(("spec", "expected"), [
    ("uniform:4", (1024, 2048, 3072, 4096)),
    ("zipf:4", (4096, 2048, 1365, 1024)),
    ("zipf:3:2", (4096, 1024, 455)),
    ("7, 4096,1", (7, 4096, 1)),
])
def test_parse_lengths(spec: str, expected: tuple[int, ...]) -> None:
    assert parse_lengths(spec, 4096) == expected


@pytest.mark.parametrize("spec", ["", "uniform", "uniform:0", "uniform:4:2", "zipf:4:-1",
                                  "zipf:4:x", "gauss:4", "1,0", "4097", "1,,2"])
def test_parse_lengths_rejects(spec: str) -> None:
    with pytest.raises(PlanError, match="--lengths"):
        parse_lengths(spec, 4096)


# --- HF config.json -----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hf_config_matches_preset(name: str, tmp_path: Path) -> None:
    model_dir = tmp_path / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    from_dir = load_model_shape(str(model_dir))
    from_file = load_model_shape(str(model_dir / "config.json"))
    assert from_dir == from_file
    preset = PRESETS[name]
    for field in ModelShape.__dataclass_fields__:
        if field != "name":
            assert getattr(from_dir, field) == getattr(preset, field), field
    kwargs = dict(context=4096, batch=8, gpu_memory_gib=80, lengths="zipf:16")
    got, want = make_plan(from_dir, **kwargs), make_plan(preset, **kwargs)  # type: ignore[arg-type]
    assert got.to_json().replace(f'"{from_dir.name}"', "") == \
        want.to_json().replace(f'"{preset.name}"', "")


def test_hf_config_head_dim_key_wins(tmp_path: Path) -> None:
    config = dict(HF_CONFIGS["llama-2-70b"], head_dim=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert load_model_shape(str(path)).head_dim == 64


# --- CLI ----------------------------------------------------------------------------------

def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--model", "llama-7b", "--context", "4096", "--batch", "32",
                    "--kv-cache-dtype", "fp16", "--gpu-memory", "80", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("bytes_per_token", "bytes_per_sequence", "bytes_total", "blocks_per_sequence",
                "max_sequences", "kv_cache_dtype", "weights_bytes", "kv_budget_bytes", "fits",
                "attention_variants", "sliding_window", "waste", "per_dtype"):
        assert key in out, key
    assert (out["bytes_per_token"], out["bytes_per_sequence"], out["bytes_total"]) == (
        524288, 2 * GIB, 64 * GIB)
    assert (out["max_sequences"], out["fits"], out["kv_cache_dtype"]) == (29, False, "fp16")
    assert out["sliding_window"] is None


def test_cli_table_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert "KiB" in out and "MiB" in out and "no --gpu-memory given" in out


@pytest.mark.parametrize(("argv", "flag"), [
    (["--model", "foo"], "--model 'foo': not a preset (llama-7b, "),
    (["--model", "/nonexistent/model/dir"], "--model '/nonexistent/model/dir': not a preset"),
    (["--model", "llama-7b", "--context", "0"], "--context 0: must be a positive integer"),
    (["--model", "llama-7b", "--batch", "-1"], "--batch -1: must be a positive integer"),
    (["--model", "llama-7b", "--block-size", "0"], "--block-size 0: must be a positive integer"),
    (["--model", "llama-7b", "--gpu-memory", "0"], "--gpu-memory 0.0: must be a positive"),
    (["--model", "llama-7b", "--gpu-memory-utilization", "1.5"],
     "--gpu-memory-utilization 1.5: must be in (0, 1]"),
    (["--model", "llama-7b", "--lengths", "zipf:x"], "--lengths 'zipf:x': accepted:"),
    (["--model", "llama-7b", "--context", "100", "--lengths", "200"], "--lengths '200'"),
])
def test_cli_bad_input_one_line_exit_2(argv: list[str], flag: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvmesh plan: {flag}"), captured.err


def test_cli_bad_model_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(["--model", str(tmp_path)]) == 2
    assert "directory has no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert run_cli(["--model", str(tmp_path)]) == 2
    assert "bad config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert run_cli(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_attention_heads missing" in err


def test_cli_unknown_dtype_rejected_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run_cli(["--model", "llama-7b", "--kv-cache-dtype", "int3"])
    assert exc.value.code == 2
    assert "--kv-cache-dtype" in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"kv_cache_dtype": "int3"}, "--kv-cache-dtype 'int3': accepted: auto, fp32"),
    ({"weights_dtype": "int2"}, "--weights-dtype 'int2': accepted: fp32, fp16"),
    ({"context": True}, "--context True"),
])
def test_make_plan_rejects(kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(PlanError) as exc:
        make_plan(PRESETS["llama-7b"], **kwargs)  # type: ignore[arg-type]
    assert str(exc.value).startswith(flag)


def test_int4_needs_even_head_dim() -> None:
    shape = ModelShape("odd", 2, 2, 2, 63, 126, 256, 1000)
    with pytest.raises(PlanError, match="--kv-cache-dtype 'int4'"):
        make_plan(shape, kv_cache_dtype="int4")
    plan = make_plan(shape)
    assert [d.kv_cache_dtype for d in plan.per_dtype] == ["fp16", "fp8", "int8"]
    assert any("int4" in w for w in plan.warnings)


@pytest.mark.multiproc
def test_planner_is_torch_free() -> None:
    code = "import sys, kvstore.plan; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[2])
