"""`spaces_between_special_tokens` in ModelTokenizer.decode: HF slow tokenizers'
meaning — kept added tokens and the text runs between them joined with a space."""
from __future__ import annotations

from pathlib import Path

from contracts.tokenizer import ModelTokenizer


def test_spaces_between_special_tokens(smollm2_dir: Path) -> None:
    tok = ModelTokenizer.from_model_dir(smollm2_dir)
    ids = tok.encode("<|im_start|>user\nHi there<|im_end|><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nHi there<|im_end|><|im_end|>"
    spaced = tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    assert spaced == "<|im_start|> user\nHi there <|im_end|> <|im_end|>"
    # Skipped special tokens leave nothing to space; plain text is untouched.
    assert tok.decode(ids, spaces_between_special_tokens=True) == tok.decode(ids) == "user\nHi there"
    plain = tok.encode("no special tokens here", add_special_tokens=False)
    assert tok.decode(plain, skip_special_tokens=False, spaces_between_special_tokens=True) == "no special tokens here"
