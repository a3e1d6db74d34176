"""Response objects of the OpenAI API (completions and chat, whole and streamed), built from choices and deltas."""

import time
from dataclasses import dataclass
from typing import Any

from pegainfer.runtime.detokenize import IncrementalDetokenizer, token_bytes, token_text
from pegainfer.runtime.tokenizer import TextTokenizer
from pegainfer.server.chat_output import ChatOutput
from pegainfer.server.generation import Choice, Delta


@dataclass(frozen=True)
class TokenNames:
    """How logprobs name a token: its text, or with vLLM's return_tokens_as_token_ids "token_id:N" (a token whose
    bytes are part of a character has no text of its own); its bytes stay its own."""
    tokenizer: TextTokenizer
    as_ids: bool = False

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else token_text(self.tokenizer, token_id)

    def bytes(self, token_id: int) -> list[int]:
        return list(token_bytes(self.tokenizer, token_id))


def usage(prompt_tokens: int, choices: list[Choice], n: int, completion: int | None = None) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice), and so do the cached ones: the most any of the
    prompt's n choices found in the prefix cache. `completion`: the tokens streamed so far, where not all."""
    completion = sum(len(c.token_ids) for c in choices) if completion is None else completion
    cached = sum(max(c.num_cached_tokens for c in choices[i:i + n]) for i in range(0, len(choices), n))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def envelope(request_id: str, kind: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": kind, "created": created or int(time.time()), "model": model}


# --- completions -------------------------------------------------------------------------------------------------

def completion_logprobs(names: TokenNames, token_ids: list[int], steps: list[dict[int, float]],
                        offsets: list[int]) -> dict[str, Any]:
    """The legacy completions form: parallel lists, top logprobs keyed by token text."""
    return {"tokens": [names.text(t) for t in token_ids],
            "token_logprobs": [step[t] for t, step in zip(token_ids, steps)],
            "top_logprobs": [{names.text(t): lp for t, lp in step.items()} for step in steps],
            "text_offset": offsets}


def prompt_offsets(tokenizer: TextTokenizer, prompt_ids: list[int], echoed: int) -> list[int]:
    """Where each prompt token's text starts in the echoed prompt (at most its length), as the incremental
    detokenizer releases it: the byte tokens of one character share the offset where it starts, instead of
    counting a U+FFFD each. A generated token's offset is its Delta's."""
    detokenizer, offsets, at = IncrementalDetokenizer(tokenizer), [], 0
    for token in prompt_ids:
        offsets.append(min(at, echoed))
        at += len(detokenizer.add(token))
    return offsets


def completion_choice(names: TokenNames, choice: Choice, prefix: str, want_logprobs: bool, prompt_ids: list[int],
                      prompt_top: int | None = None, token_ids: bool = False) -> dict:
    """An echoed prompt's tokens lead the logprobs where they were computed (the first null, as vLLM gives it);
    with `token_ids` (return_token_ids) the prompt's ids and the choice's beside its text."""
    logprobs = None
    if want_logprobs:
        offsets = [len(prefix) + offset for offset in choice.offsets]
        logprobs = completion_logprobs(names, choice.token_ids, choice.logprobs, offsets)
        if prefix and choice.prompt_logprobs is not None:
            logprobs = _prepend_prompt(names, prompt_ids, choice.prompt_logprobs, logprobs, len(prefix))
    body = {"index": choice.index, "text": prefix + choice.text, "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
    if token_ids:
        body |= {"prompt_token_ids": prompt_ids, "token_ids": choice.token_ids}
    return body | prompt_logprobs_field(names.tokenizer, choice, prompt_ids, prompt_top)


def prompt_logprobs_field(tokenizer: TextTokenizer, choice: Choice, prompt_ids: list[int],
                          top: int | None) -> dict[str, Any]:
    """vLLM's prompt_logprobs of a choice, where the request asked for them (`top`: how many a position)."""
    if top is None or choice.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": prompt_logprobs(tokenizer, prompt_ids, choice.prompt_logprobs, top)}


def _prepend_prompt(names: TokenNames, prompt_ids: list[int], steps: list[dict[int, float]],
                    logprobs: dict[str, Any], echoed: int) -> dict[str, Any]:
    offsets = prompt_offsets(names.tokenizer, prompt_ids, echoed)
    prompt = completion_logprobs(names, prompt_ids[1:], steps, offsets[1:])
    return {"tokens": [names.text(prompt_ids[0]), *prompt["tokens"], *logprobs["tokens"]],
            "token_logprobs": [None, *prompt["token_logprobs"], *logprobs["token_logprobs"]],
            "top_logprobs": [None, *prompt["top_logprobs"], *logprobs["top_logprobs"]],
            "text_offset": [offsets[0], *prompt["text_offset"], *logprobs["text_offset"]]}


def prompt_logprobs(tokenizer: TextTokenizer, prompt_ids: list[int], steps: list[dict[int, float]],
                    top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: null for the first token, then each position's {id: logprob, rank, decoded_token},
    rank 1 the most likely; the prompt's own token past the top `top` has no rank here (null)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for step in steps:
        ranked = [t for t, _ in sorted(step.items(), key=lambda item: -item[1])][:top]
        out.append({str(t): {"logprob": lp, "rank": ranked.index(t) + 1 if t in ranked else None,
                             "decoded_token": token_text(tokenizer, t)} for t, lp in step.items()})
    return out


def completion_chunk(names: TokenNames, base: dict, delta: Delta, prefix: str, offset: int,
                     prompt: tuple[list[int], list[dict[int, float]]] | None = None) -> dict:
    """A streamed token; the choice's first carries the echoed prompt (`prefix`) and, where it has them, the
    prompt's logprobs (`prompt`: its ids and steps) before its own, as the whole response has them."""
    logprobs = None if delta.logprobs is None else \
        completion_logprobs(names, [delta.token_id], [delta.logprobs], [offset])
    if logprobs is not None and prefix and prompt is not None:
        logprobs = _prepend_prompt(names, *prompt, logprobs, len(prefix))
    return {**base, "choices": [{"index": delta.index, "text": prefix + delta.text, "logprobs": logprobs,
                                 "finish_reason": delta.finish_reason}]}


# --- chat --------------------------------------------------------------------------------------------------------

def chat_logprob(names: TokenNames, token_id: int, step: dict[int, float], top: int) -> dict[str, Any]:
    ranked = sorted(step.items(), key=lambda item: -item[1])[:top]
    return {**_token_entry(names, token_id, step[token_id]),
            "top_logprobs": [_token_entry(names, t, lp) for t, lp in ranked]}


def _token_entry(names: TokenNames, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": names.text(token_id), "logprob": logprob, "bytes": names.bytes(token_id)}


def chat_choice(names: TokenNames, choice: Choice, top: int | None, output: ChatOutput, echo: str = "",
                token_ids: bool = False) -> dict:
    """`echo`: the text the answer's content starts with (chat echo); `token_ids`: the choice's ids beside it."""
    logprobs = None if top is None else {"content": [chat_logprob(names, t, step, top)
                                                     for t, step in zip(choice.token_ids, choice.logprobs)]}
    message, calls = output.message(choice.text)
    if echo:
        message["content"] = echo + (message["content"] or "")
    return {"index": choice.index, "message": message, "logprobs": logprobs,
            "finish_reason": tool_finish(choice.finish_reason, calls), "stop_reason": choice.stop_reason,
            **({"token_ids": choice.token_ids} if token_ids else {})}


def tool_finish(finish_reason: str | None, calls: bool) -> str | None:
    """A choice that stopped after calling tools finishes with "tool_calls", as OpenAI's do."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def chat_chunk(names: TokenNames, base: dict, delta: Delta, top: int | None, message: dict,
               finish_reason: str | None) -> dict:
    """A chunk of one choice: `message` the delta object (content, reasoning or tool-call pieces)."""
    logprobs = None if top is None or delta.logprobs is None else \
        {"content": [chat_logprob(names, delta.token_id, delta.logprobs, top)]}
    return {**base, "choices": [{"index": delta.index, "delta": message, "logprobs": logprobs,
                                 "finish_reason": finish_reason}]}


def chat_role_chunk(base: dict, index: int) -> dict:
    return {**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}
