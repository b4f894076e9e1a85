"""One model's tokenizer for router and worker: HF `tokenizer.json` + chat template, without
transformers or torch.

Both sides load it the same way (`ModelTokenizer.from_model_dir`; the worker through
`worker.model.loader.load_tokenizer`), so they turn the same text or chat into the same ids.
`transformers.AutoTokenizer` is not used: it imports torch, which the router must not, and it
picks a tokenizer class from the model type (a Qwen2 dir gets `Qwen2Tokenizer` whatever its
`tokenizer.json` holds), so it can disagree with the files. This class reads the files with
`tokenizers` and renders the chat template with jinja2 the way transformers does:

- `encode(text)`: special tokens are added exactly as tokenizer.json's post-processor says
  (transformers 5 ignores `add_bos_token` / `add_eos_token` in tokenizer_config.json for these
  tokenizers, and so does this class — tests/contracts/test_tokenizer.py pins that);
- `decode(ids)`: the `tokenizers` decoder, then transformers' `clean_up_tokenization` when
  tokenizer_config.json asks for it (never for BPE models, as transformers 5);
- `apply_chat_template(messages)`: the template rendered with the generation prompt, then
  `encode(add_special_tokens=False)`.

The files travel too (a router without the model's storage asks a worker for them,
`Worker.GetTokenizer`): `read_tokenizer_files(dir)` reads the `TOKENIZER_FILES` a dir has,
`tokenizer_files_digest(files)` names them (the worker's `ModelInfo.tokenizer_sha256`), and
`ModelTokenizer.from_files(files)` loads them exactly as `from_model_dir` loads the dir
(`from_model_dir` is `from_files(read_tokenizer_files(dir))`).
"""
from __future__ import annotations

import hashlib
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
# What `from_files` / `from_model_dir` read (tokenizer.json is required, the others optional).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")   # the last: the router's default temperature (vLLM's rule)
MAX_TOKENIZER_BYTES = 32 * 2**20     # what a worker sends at most (`read_tokenizer_files`' default bound)
# The largest TokenizerFiles message: the files plus room for names, model, salt and digest.
# A client of Worker.GetTokenizer needs a receive limit of at least this.
MAX_TOKENIZER_MESSAGE_BYTES = MAX_TOKENIZER_BYTES + 2**20


class TokenizerError(ValueError):
    """The model dir has no usable tokenizer / chat template, or the template rejected the chat."""


class TokenizerFilesTooLarge(TokenizerError):
    """The tokenizer files together exceed the bound a worker sends (`MAX_TOKENIZER_BYTES`)."""


def read_tokenizer_files(path: str | Path, max_bytes: int | None = MAX_TOKENIZER_BYTES) -> dict[str, bytes]:
    """The `TOKENIZER_FILES` that `path` has, name -> bytes. Raises TokenizerError without
    tokenizer.json, TokenizerFilesTooLarge when they add up to more than `max_bytes` (checked
    on their sizes before any is read; None: no bound)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise TokenizerError(f"{path} has no tokenizer.json (kvmesh needs an HF fast tokenizer)")
    present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    try:
        if max_bytes is not None:
            total = sum((path / name).stat().st_size for name in present)
            if total > max_bytes:
                raise TokenizerFilesTooLarge(f"the tokenizer files of {path} ({', '.join(present)}) are "
                                             f"{total} bytes, more than the {max_bytes} a worker sends")
        return {name: (path / name).read_bytes() for name in present}
    except OSError as e:
        raise TokenizerError(f"cannot read the tokenizer files of {path}: {e}") from e


def tokenizer_files_digest(files: Mapping[str, bytes]) -> str:
    """sha256 (lowercase hex) over the files sorted by name, each as: len(name) as 4 bytes
    little-endian, the name in UTF-8, len(data) as 8 bytes little-endian, the data. Equal
    digests: the same names with the same bytes (the lengths make the encoding unambiguous)."""
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        raw = name.encode("utf-8")
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


class ModelTokenizer:
    """Encode, decode and chat-template one model's text. Immutable after construction; safe
    to share between threads (`tokenizers` and the compiled template keep no per-call state)."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None,
                 special_tokens: Mapping[str, str], clean_up_tokenization_spaces: bool = False) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self._template = _compile(chat_template) if chat_template else None
        # transformers 5 skips the clean-up for BPE models whatever the config says
        self._clean_up = clean_up_tokenization_spaces and type(tokenizer.model).__name__ != "BPE"
        # added tokens: id -> (content, special), for spaces_between_special_tokens
        self._added = {i: (t.content, bool(t.special)) for i, t in tokenizer.get_added_tokens_decoder().items()}

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelTokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` (+ `special_tokens_map.json`,
        `chat_template.jinja`) from an HF model dir; raises TokenizerError if absent."""
        return cls.from_files(read_tokenizer_files(path, max_bytes=None), source=str(path))

    @classmethod
    def from_files(cls, files: Mapping[str, bytes], source: str = "tokenizer files") -> ModelTokenizer:
        """Load the `TOKENIZER_FILES` given as name -> bytes (what `read_tokenizer_files`
        returns, or what a worker sent). Raises TokenizerError without tokenizer.json, for a
        name outside `TOKENIZER_FILES`, or for a file that does not parse; `source` names them
        in errors."""
        unknown = sorted(set(files) - set(TOKENIZER_FILES))
        if unknown:
            raise TokenizerError(f"{source}: unexpected files {unknown}; expected some of {list(TOKENIZER_FILES)}")
        if "tokenizer.json" not in files:
            raise TokenizerError(f"{source} has no tokenizer.json (kvmesh needs an HF fast tokenizer)")
        try:
            tokenizer = Tokenizer.from_str(_text(files, "tokenizer.json", source))
        except Exception as e:   # noqa: BLE001 - tokenizers raises a bare Exception for bad JSON
            raise TokenizerError(f"{source}: cannot load tokenizer.json: {e}") from e
        config = _read_json(files, "tokenizer_config.json", source)
        special: dict[str, str] = {}
        for source_map in (_read_json(files, "special_tokens_map.json", source), config):
            for name in _SPECIAL_NAMES:
                token = _token_content(source_map.get(name))
                if token is not None:
                    special[name] = token
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: transformers uses "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not template and "chat_template.jinja" in files:
            # universal newlines, as Path.read_text reads it
            template = _text(files, "chat_template.jinja", source).replace("\r\n", "\n").replace("\r", "\n")
        return cls(tokenizer, template or None, special,
                   clean_up_tokenization_spaces=config.get("clean_up_tokenization_spaces") is True)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (with added tokens); the model's vocab may be larger."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config's `eos_token`. The engine stops on the model's
        `eos_token_ids` (config.json / generation_config.json), which may list more."""
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.token_id(eos)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.token_id(bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Releases the GIL while it runs (`encode_batch` does, `encode`
        does not), so callers may run it in a thread beside an event loop."""
        return list(self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = False) -> str:
        """The text of `ids`. A multi-byte character cut at the end decodes to U+FFFD; the
        engine holds such a tail back until the next token completes it.
        `spaces_between_special_tokens` (vLLM's request field, with the meaning of HF's slow
        tokenizers): the added tokens that are kept and the runs of text between them are
        joined with a space. Off, the fast tokenizer's decoding (what transformers and vLLM's
        fast path return)."""
        ids = list(ids)
        if not spaces_between_special_tokens or not any(t in self._added for t in ids):
            return self._decode(ids, skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            added = self._added.get(t)
            if added is None:
                run.append(t)
                continue
            if skip_special_tokens and added[1]:
                continue
            if run:
                parts.append(self._decode(run, skip_special_tokens))
                run = []
            parts.append(added[0])
        if run:
            parts.append(self._decode(run, skip_special_tokens))
        return " ".join(parts)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        text = str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
        return _clean_up_tokenization(text) if self._clean_up else text

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


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (spaces before punctuation and contractions)."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


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


def _text(files: Mapping[str, bytes], name: str, source: str) -> str:
    try:
        return files[name].decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"cannot parse {source}/{name}: {e}") from e


def _read_json(files: Mapping[str, bytes], name: str, source: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        data = json.loads(_text(files, name, source))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"cannot parse {source}/{name}: {e}") from e
    return data if isinstance(data, dict) else {}
