"""ModelTokenizer (tokenizers + jinja2, no torch) against transformers' AutoTokenizer — the oracle —
and router and worker agreeing on it: the engine loads the very same class from the same files."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contracts.tokenizer import ModelTokenizer, TokenizerError

TEXTS = [
    "Hello world", " leading space", "trailing space ", "The capital of France is",
    "héllo wörld — 日本語のテキスト 🎉🚀 naïve café", "tabs\tand\nnew\n\nlines  double  spaces",
    "<|im_start|>user\nspecial tokens in text<|im_end|>", "print('x')\n    return {'a': 1}", "ÅΩ∑€", "a" * 300,
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Traduis: « où est la gare ? » 🚉"},
     {"role": "assistant", "content": "Where is the station?"},
     {"role": "user", "content": "日本語で?"}],
    [{"role": "user", "content": "  spaces and\nnewlines\n"}],
]


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_model_dir(smollm2_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_equals_transformers(tok: ModelTokenizer, hf: Any, text: str) -> None:
    assert tok.encode(text) == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_equals_transformers(tok: ModelTokenizer, hf: Any, text: str) -> None:
    ids = hf.encode(text)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_equals_engine_path(tok: ModelTokenizer, hf: Any, messages: list[dict[str, str]]) -> None:
    # What worker.engine.engine.Engine.apply_chat_template does, with the same transformers tokenizer.
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tok.render_chat(messages) == text
    assert tok.apply_chat_template(messages) == hf.encode(text, add_special_tokens=False)


def test_special_tokens_and_template_loaded(tok: ModelTokenizer, hf: Any) -> None:
    assert tok.special_tokens["bos_token"] == hf.bos_token
    assert tok.special_tokens["eos_token"] == hf.eos_token
    assert tok.chat_template == hf.chat_template
    assert tok.token_id(hf.eos_token) == hf.eos_token_id


def test_add_bos_token_config_follows_transformers(smollm2_dir: Path, tmp_path: Path) -> None:
    """Whatever transformers does with `add_bos_token` in tokenizer_config, the router does too."""
    import json
    import shutil

    from transformers import AutoTokenizer
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True}))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    tok = ModelTokenizer.from_model_dir(tmp_path)
    for text in TEXTS[:4]:
        assert tok.encode(text) == hf.encode(text)


def test_template_raise_exception_and_missing_files(tok: ModelTokenizer, tmp_path: Path) -> None:
    strict = ModelTokenizer(tok._tokenizer, "{{ raise_exception('roles must alternate') }}", tok.special_tokens)
    with pytest.raises(TokenizerError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        ModelTokenizer(tok._tokenizer, None, {}).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        ModelTokenizer.from_model_dir(tmp_path)


@pytest.mark.multiproc
def test_router_modules_import_without_torch() -> None:
    code = ("import sys\n"
            "import contracts.tokenizer, router.routing.policy, router.server, router.fronts.openai.app\n"
            "import kvmesh.client, kvmesh.cli\n"
            "import kvmesh.serve.local, kvmesh.serve.ray_launch, kvmesh.serve.cli, kvmesh.demo\n"
            "import kvmesh.cli as c; c.build_parser()\n"
            "bad = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]\n"
            "assert not bad, bad\n")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=60)


# -- router and worker: one tokenizer ------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Any:
    from worker.engine.engine import Engine, EngineConfig
    return Engine(EngineConfig(model=str(smollm2_dir), num_blocks=64))


def test_worker_engine_loads_the_same_tokenizer(engine: Any) -> None:
    assert type(engine.tokenizer) is ModelTokenizer
    assert engine.tokenizer.eos_token_id in engine.model_config.eos_token_ids


@pytest.mark.parametrize("text", TEXTS)
def test_router_and_worker_encode_text_alike(engine: Any, tok: ModelTokenizer, hf: Any, text: str) -> None:
    # `tok` is what the router loads (ModelTokenizer.from_model_dir on the resolved model dir)
    assert engine.encode(text) == tok.encode(text) == hf.encode(text)


@pytest.mark.parametrize("messages", CHATS)
def test_router_and_worker_template_chats_alike(engine: Any, tok: ModelTokenizer, hf: Any,
                                                messages: list[dict[str, str]]) -> None:
    expected = hf.encode(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
    assert engine.apply_chat_template(messages) == tok.apply_chat_template(messages) == expected


def test_engine_maps_a_template_error_to_invalid_request(engine: Any, tok: ModelTokenizer) -> None:
    from worker.engine.request import InvalidRequest
    loaded = engine.tokenizer
    engine.tokenizer = ModelTokenizer(tok._tokenizer, "{{ raise_exception('roles must alternate') }}",
                                      tok.special_tokens)
    try:
        with pytest.raises(InvalidRequest, match="roles must alternate"):
            engine.apply_chat_template([{"role": "user", "content": "x"}])
    finally:
        engine.tokenizer = loaded


@pytest.mark.parametrize("text", TEXTS)
def test_prefix_decodes_grow_into_the_text(tok: ModelTokenizer, hf: Any, text: str) -> None:
    """What the engine's incremental detokenization relies on: the text of every prefix of the
    ids, less a trailing U+FFFD (a character cut mid-bytes), is a prefix of the whole text."""
    ids = tok.encode(text)
    for skip in (True, False):
        whole = tok.decode(ids, skip_special_tokens=skip)
        assert whole == hf.decode(ids, skip_special_tokens=skip)
        for n in range(len(ids) + 1):
            assert whole.startswith(tok.decode(ids[:n], skip_special_tokens=skip).rstrip("\ufffd"))


def test_stream_text_equals_final_text(engine: Any) -> None:
    from worker.engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = engine.apply_chat_template([{"role": "user", "content": "Écris « bonjour » en japonais 🎌"}])
    streamed = "".join(out.new_text for out in engine.stream(prompt, params))
    final = engine.generate(prompt, params)[0]
    assert streamed == final.text == engine.tokenizer.decode(final.token_ids)
