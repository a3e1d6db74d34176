"""The checkpoint's tokenizer.json (through `tokenizers`), its end-of-sequence ids and tokenizer_config.json."""

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pegainfer.errors import CheckpointError, RequestError

FILE_KEYS = ("vocab_file", "merges_file", "tokenizer_file")  # paths on the server's disk: no use to a client
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
ADDED_TOKEN_KEYS = {"__type", "content", "lstrip", "rstrip", "normalized", "single_word", "special"}


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json, as transformers reads it

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def without_added_specials(self, token_ids: list[int]) -> list[int]:
        """Ids encoded with special tokens, less those the post-processor added (a BOS that a chat template writes
        itself): the ids of add_special_tokens=False. Special tokens written in the text itself stay."""
        before, after = self._added_specials
        return token_ids[before:len(token_ids) - after]

    def keep_last(self, token_ids: list[int], keep: int) -> list[int]:
        """The last `keep` ids of an encoding with special tokens, those the post-processor added kept in their
        places (transformers' truncation from the left: a BOS stays first)."""
        before, after = self._added_specials
        core = token_ids[before:len(token_ids) - after]
        room = max(keep - before - after, 0)
        kept = token_ids[:before] + (core[-room:] if room else []) + token_ids[len(token_ids) - after:]
        return kept[-keep:]  # never more than asked, where the specials alone are more

    @cached_property
    def _added_specials(self) -> tuple[int, int]:
        """How many ids the post-processor puts before and after a single sequence, found on a probe text."""
        processor = self.tokenizer.post_processor
        added = processor.num_special_tokens_to_add(False) if processor is not None else 0
        if not added:
            return 0, 0
        probes = ["a", "hello", "0"] + [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        for probe in probes:
            core, whole = self.encode(probe, add_special_tokens=False), self.encode(probe)
            starts = [i for i in range(added + 1) if core and whole[i:i + len(core)] == core]
            if len(whole) == len(core) + added and len(starts) == 1:  # a probe like the added token is ambiguous
                return starts[0], added - starts[0]
        return added, 0  # no probe encodes: a prefix (BOS) is the usual template

    def info(self, chat_template: str | None, max_model_len: int) -> dict[str, Any]:
        """GET /tokenizer_info as vLLM answers it: tokenizer_config.json less file paths, tokens as their text, the
        class transformers loads, the chat template; every special token key present (lm-eval's remote tokenizer
        reads eos_token). model_max_length is the server's limit, what a prompt plus its completion may hold."""
        info = {key: _plain(value) for key, value in self.config.items() if key not in FILE_KEYS}
        name = info.get("tokenizer_class")
        info["tokenizer_class"] = (name if name.endswith("Fast") else name + "Fast") if isinstance(name, str) \
            else "PreTrainedTokenizerFast"
        for key in SPECIAL_TOKEN_KEYS:
            info.setdefault(key, None)
        if info["eos_token"] is None and self.eos_token_ids:
            info["eos_token"] = self.tokenizer.id_to_token(min(self.eos_token_ids))
        info["model_max_length"] = max_model_len
        info["chat_template"] = chat_template
        return info


def load_tokenizer(folder: Path) -> TextTokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no tokenizer.json (needed for text prompts; use --prompt-ids instead)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001  tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{path}: not a readable tokenizer ({error})") from None
    config_path = folder / "tokenizer_config.json"
    config = _read_json_object(config_path) if config_path.is_file() else {}
    return TextTokenizer(tokenizer, eos_token_ids(folder), config)


def eos_token_ids(folder: Path) -> frozenset[int]:
    """generation_config.json's eos_token_id (an id or a list) wins over config.json's, as in transformers."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            value = _read_json_object(path).get("eos_token_id")
            if value is not None:
                return _token_ids(value, path)
    return frozenset()


# what vLLM takes from it, less repetition_penalty: a checkpoint's default one (1.05 in some) would put every row of
# every request under penalties, whose terms the host builds each step over the prompt's ids (PenaltyState.terms)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")


def sampling_defaults(folder: Path) -> dict[str, float]:
    """generation_config.json's sampling parameters, the defaults of a request that leaves them out (vLLM's
    --generation-config auto); a value of the wrong type is the checkpoint's error, with its file."""
    path = folder / "generation_config.json"
    config = _read_json_object(path) if path.is_file() else {}
    defaults = {}
    for name in SAMPLING_DEFAULTS:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{path}: {name} must be a number, found {json.dumps(value)}")
        defaults[name] = value
    return defaults


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


def _plain(value: Any) -> Any:
    """An added token's object ({"content": "<s>", "lstrip": ...}) as its text, as vLLM serializes AddedToken."""
    if isinstance(value, dict) and isinstance(value.get("content"), str) and value.keys() <= ADDED_TOKEN_KEYS:
        return value["content"]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return [_plain(item) for item in value] if isinstance(value, list) else value
