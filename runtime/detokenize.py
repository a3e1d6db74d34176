"""Text out of a token stream: incremental detokenization that never cuts a UTF-8 character, stop strings matched
across token boundaries, and each token's own text and bytes for logprobs."""

from collections.abc import Sequence
from functools import lru_cache

from pegainfer.runtime.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"  # what decoding gives for bytes that are not (yet) a whole character
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first generated one, as vLLM's detokenizer starts


class IncrementalDetokenizer:
    """Decodes a window of recent tokens instead of the whole output each time: context tokens (already emitted,
    or the prompt's last few) and the tokens after them. New text is released only once it no longer ends in a
    partial character, so a character split over several byte tokens comes out whole, in the chunk of its last byte.

    Starting from the prompt's tail (vLLM's prefix and read offsets) keeps the space a SentencePiece or word-level
    tokenizer puts before the first generated word, which decoding that token alone drops."""

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int] = (), skip_special: bool = True) -> None:
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self._window: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)  # the window's tokens before this one have been emitted (or are prompt)

    def add(self, token_id: int) -> str:
        self._window.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is still held back, at the end of the stream (a partial character then stays a U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        emitted = self.tokenizer.decode(self._window[:self._read], self.skip_special)
        text = self.tokenizer.decode(self._window, self.skip_special)
        # a prompt that ends inside a character: the token completing it emits the whole character
        start = len(emitted) if text.startswith(emitted) else len(emitted.rstrip(REPLACEMENT))
        if len(text) <= start or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        return text[start:]


def decode_completion(tokenizer: TextTokenizer, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> str:
    """The completion's text as the server streams it after this prompt (with the space before its first word)."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    return "".join(detokenizer.add(t) for t in token_ids) + detokenizer.flush()


class StopChecker:
    """Holds back text that might be the start of a stop string; cuts the text before the first stop string found
    (after it, with `include`: vLLM's include_stop_str_in_output). Emitted text never contains the start of a stop
    string that could still complete, so only held-back text needs searching."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.pending = ""
        self.matched: str | None = None  # the stop string found

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now; sets `matched` once a stop string has appeared."""
        assert not self.stopped, "fed after a stop string was found"
        self.pending += text
        found = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if found:
            at, self.matched = min(found, key=lambda hit: (hit[0], -len(hit[1])))
            out, self.pending = self.pending[:at + (len(self.matched) if self.include else 0)], ""
            return out
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character: printable Latin-1 bytes as themselves, the
    others (controls, space, ...) as the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    alphabet.update({chr(0x100 + i): b for i, b in enumerate(others)})
    return alphabet


def token_text(tokenizer: TextTokenizer, token_id: int) -> str:
    return tokenizer.tokenizer.decode([token_id], skip_special_tokens=False)


def token_bytes(tokenizer: TextTokenizer, token_id: int) -> bytes:
    """The token's bytes: exact for byte-level BPE (a token may hold part of a character), else its text's."""
    piece = tokenizer.tokenizer.id_to_token(token_id)
    alphabet = _byte_level_alphabet()
    if type(tokenizer.tokenizer.decoder).__name__ == "ByteLevel" and piece and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return token_text(tokenizer, token_id).encode()
