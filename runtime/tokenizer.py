"""The checkpoint's tokenizer.json (through `tokenizers`), its end-of-sequence ids and its chat template."""

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from pegainfer.errors import CheckpointError, RequestError


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(folder: Path) -> TextTokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no tokenizer.json (needed for text prompts; use --prompt-ids instead)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001  tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{path}: not a readable tokenizer ({error})") from None
    return TextTokenizer(tokenizer, eos_token_ids(folder))


def eos_token_ids(folder: Path) -> frozenset[int]:
    """generation_config.json's eos_token_id (an id or a list) wins over config.json's, as in transformers."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            value = _read_json_object(path).get("eos_token_id")
            if value is not None:
                return _token_ids(value, path)
    return frozenset()


def _read_json_object(path: Path) -> dict:
    try:
        content = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(content).__name__}")
    return content


def _token_ids(value: object, path: Path) -> frozenset[int]:
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of token ids (integers >= 0), "
                              f"found {json.dumps(value)}")
    return frozenset(ids)


def check_prompt_ids(token_ids: list[int], vocab_size: int) -> None:
    if not token_ids:
        raise RequestError("the prompt is empty: give at least one token")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is out of range: the vocabulary has ids 0..{vocab_size - 1}")
