"""The asyncio side of the engine loop: a request's tokens as an async stream, and one choice of a response as
text deltas (incremental detokenization, stop strings), logprobs and usage. Leaving a stream early (a stop string,
a client gone) aborts its engine request, which frees its KV blocks."""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pegainfer.runtime.detokenize import IncrementalDetokenizer, StopChecker
from pegainfer.runtime.engine_loop import EngineLoop, LoopSink
from pegainfer.runtime.requests import EngineRequest, TokenOutput
from pegainfer.runtime.tokenizer import TextTokenizer
from pegainfer.server.metrics import Metrics

_CANCELLED = object()


class RequestStream:
    """A submitted engine request; `next` returns its TokenOutputs, then None once finished or cancelled."""

    def __init__(self, engine: EngineLoop, request: EngineRequest) -> None:
        self.engine, self.request_id = engine, request.request_id
        self.finished = False
        self._queue: asyncio.Queue = asyncio.Queue()
        engine.submit(request, LoopSink(asyncio.get_running_loop(), self._queue.put_nowait))

    async def next(self) -> TokenOutput | None:
        if self.finished:
            return None
        item = await self._queue.get()
        if item is _CANCELLED:
            return None
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finish_reason is not None
        return item

    def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
            self._queue.put_nowait(_CANCELLED)


@dataclass(frozen=True)
class TextOptions:
    """How a choice's tokens become its text: stop strings, and vLLM's include_stop_str_in_output (the stop string,
    or the stop token's text, kept) and skip_special_tokens."""
    stops: list[str] = field(default_factory=list)
    include_stop: bool = False
    skip_special: bool = True


@dataclass
class Delta:
    """What one engine token adds to a choice: text (possibly empty: held back), the token, its logprobs, and where
    its text starts in the choice's text (the token's text_offset)."""
    index: int
    text: str
    token_id: int
    logprobs: dict[int, float] | None
    finish_reason: str | None
    offset: int


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each token's Delta.offset
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids id that ended the choice
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float]] | None = None  # positions 1 on, where the request asked


async def run_choice(engine: EngineLoop, request: EngineRequest, tokenizer: TextTokenizer, options: TextOptions,
                     index: int, metrics: Metrics, choice: Choice) -> AsyncIterator[Delta]:
    """Yields a Delta per generated token and fills `choice` as it goes; the last Delta has the finish_reason.
    A stop string ends the choice with "stop", cut before the stop string; it is looked for only once min_tokens
    tokens are out, as vLLM does. The text of the token that stops a choice (an end-of-sequence or stop_token_ids
    id) is left out, as vLLM leaves it, unless the request asks for include_stop_str_in_output."""
    detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_ids, options.skip_special)
    checker = StopChecker(options.stops, options.include_stop)
    stream = RequestStream(engine, request)
    last = first_token = request.arrival
    try:
        while (out := await stream.next()) is not None:
            (metrics.itl if choice.token_ids else metrics.ttft).observe(out.time - last)
            if not choice.token_ids:
                first_token = out.time
            last = out.time
            stop_token = out.finish_reason == "stop"
            piece = "" if stop_token and not options.include_stop else detokenizer.add(out.token_id)
            text = piece if len(choice.token_ids) + 1 < request.params.min_tokens else checker.feed(piece)
            finish = "stop" if checker.stopped else out.finish_reason
            if finish and not checker.stopped:
                text += checker.feed(detokenizer.flush())
                text += "" if checker.stopped else checker.flush()
                finish = "stop" if checker.stopped else finish  # a stop string in the last held-back text
            offset = len(choice.text)
            choice.text += text
            choice.offsets.append(offset)
            choice.token_ids.append(out.token_id)
            choice.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                choice.prompt_logprobs = out.prompt_logprobs
            if out.logprobs is not None:
                choice.logprobs.append(out.logprobs)
            if finish:
                choice.finish_reason = finish
                choice.stop_reason = checker.matched if checker.stopped else \
                    stop_token_reason(out.token_id, request, tokenizer) if stop_token else None
                metrics.observe_finished(request, out, first_token, len(choice.token_ids), finish)
            yield Delta(index, text, out.token_id, out.logprobs, finish, offset)
            if finish:
                return
    finally:
        if choice.finish_reason is None:
            metrics.finished["abort"] += 1
        stream.cancel()


def stop_token_reason(token: int, request: EngineRequest, tokenizer: TextTokenizer) -> int | None:
    """A stop_token_ids id that ended the choice; None for an end-of-sequence token, even one listed there
    (vLLM checks EOS first)."""
    eos = token in tokenizer.eos_token_ids and not request.params.ignore_eos
    return token if token in request.stop_token_ids and not eos else None
