"""The router's tokenizer: HF `tokenizer.json` + chat template, without transformers or torch.

`transformers.AutoTokenizer` imports torch, and the router must not (DESIGN.md). This class
reads the same files with `tokenizers` and renders the chat template with jinja2 the way
transformers does, so the router and a worker turn the same text / chat into the same ids:

- `encode(text)` == `AutoTokenizer.from_pretrained(dir).encode(text)`: special tokens are
  added exactly as tokenizer.json's post-processor says (transformers 5 ignores
  `add_bos_token` / `add_eos_token` in tokenizer_config.json for these tokenizers, and so
  does this class — the tests pin that against transformers);
- `apply_chat_template(messages)` == transformers' `apply_chat_template(messages,
  add_generation_prompt=True, tokenize=False)` then `encode(add_special_tokens=False)`,
  which is what the worker's `Engine.apply_chat_template` does.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """The model dir has no usable tokenizer / chat template, or the template rejected the chat."""


class RouterTokenizer:
    """Encode, decode and chat-template one model's text. Immutable after construction."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None,
                 special_tokens: Mapping[str, str]) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_model_dir(cls, path: str | Path) -> RouterTokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` (+ `special_tokens_map.json`,
        `chat_template.jinja`) from an HF model dir; raises TokenizerError if absent."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"{path} has no tokenizer.json (the router needs a fast tokenizer)")
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special: dict[str, str] = {}
        for source in (_read_json(path / "special_tokens_map.json"), config):
            for name in _SPECIAL_NAMES:
                token = _token_content(source.get(name))
                if token is not None:
                    special[name] = token
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not template and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tokenizer, template or None, special)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (with added tokens); the model's vocab may be larger."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Releases the GIL while it runs (`encode_batch` does, `encode`
        does not), so callers may run it in a thread beside an event loop."""
        return list(self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template's text for `messages`; raises TokenizerError (no template, or the
        template's own `raise_exception`, e.g. roles out of order)."""
        if self._template is None:
            raise TokenizerError("this model has no chat template")
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Render with the generation prompt and encode without adding special tokens."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _compile(template: str) -> jinja2.Template:
    """Same environment as transformers' `_compile_jinja_template` (minus generation tracking)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from None


def _token_content(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):  # a serialized AddedToken
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot parse {path}: {e}") from e
    return data if isinstance(data, dict) else {}
