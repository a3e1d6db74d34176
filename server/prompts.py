"""Prompt text to token ids for the server: off the event loop, one encode at a time, and bounded by the context
length, so that a huge prompt is refused for about the cost of a prompt at the limit instead of stalling every
other request and holding hundreds of MB of the tokenizer's buffers."""

import asyncio
import ctypes
import ctypes.util
from concurrent.futures import ThreadPoolExecutor
from functools import cache

from pegainfer.runtime.tokenizer import TextTokenizer
from pegainfer.server.errors import ContextTooLong

PROBE_TOKENS_SLACK = 64  # a prefix's encoding can differ from the whole text's only around the cut
PROBE_CHARS_PER_TOKEN = 8  # first probe: 8 characters a token, past what natural text averages
TRIM_CHARS = 1 << 20  # encodes this large give their buffers back to the OS afterwards


class PromptEncoder:
    """Encodes prompts in one worker thread with `encode_batch`, which releases the GIL (`encode` holds it), so
    the event loop keeps answering while a long prompt is tokenized, and at most one encode's buffers exist."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.longest_token = longest_token_chars(tokenizer)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pegainfer-tokenize")

    async def encode(self, text: str, max_tokens: int, param: str, context: int) -> list[int]:
        """The ids of `text`; a 400 naming `param` once the text surely has more than `max_tokens` tokens
        (`context`, the model's context length, is what the message quotes)."""
        if len(text) > max_tokens * self.longest_token:
            raise ContextTooLong(f"This model's maximum context length is {context} tokens; the prompt has "
                                 f"{len(text)} characters, more than {max_tokens} tokens can hold (this tokenizer's "
                                 f"longest token has {self.longest_token} characters). Shorten the prompt.", param)
        loop = asyncio.get_running_loop()
        probe = max_tokens * PROBE_CHARS_PER_TOKEN
        while probe * 2 < len(text):  # growing prefixes: refuse before encoding all of a text far past the limit
            count = len(await loop.run_in_executor(self._pool, self._encode, text[:probe]))
            if count > max_tokens + PROBE_TOKENS_SLACK:
                raise ContextTooLong(f"This model's maximum context length is {context} tokens; the prompt has more "
                                     f"than {count - PROBE_TOKENS_SLACK} tokens in its first {probe} characters "
                                     f"alone. Shorten the prompt.", param)
            probe *= 4
        return await loop.run_in_executor(self._pool, self._encode, text)

    async def encode_tail(self, text: str, keep: int) -> list[int]:
        """The ids of the text's end, at least its last `keep` tokens (truncate_prompt_tokens): only the characters
        `keep` tokens and the slack around the cut can cover are encoded, so a huge text costs what `keep` does."""
        chars = (keep + PROBE_TOKENS_SLACK) * self.longest_token
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, text[-chars:])

    def _encode(self, text: str) -> list[int]:
        (encoding,) = self.tokenizer.tokenizer.encode_batch([text])
        ids = encoding.ids
        del encoding
        if len(text) >= TRIM_CHARS:
            release_free_memory()
        return ids

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def longest_token_chars(tokenizer: TextTokenizer) -> int:
    """An upper bound on the characters of text one token covers: the longest vocabulary entry (byte-level and
    Metaspace entries spell each byte or space with one character, so the text a token decodes to is no longer)."""
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=1)


def release_free_memory() -> None:
    """Hands the C heap's free pages back to the OS (glibc's malloc_trim): a long encode's buffers otherwise stay
    resident after they are freed. A no-op where the C library has no malloc_trim."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None
