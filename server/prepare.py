"""Preparing an API request: its common checks, its prompts as ids, each choice's sampling parameters, its chat
template rendered (with its tools), and its constraint (structured outputs, required tool calls) compiled."""

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pegainfer.errors import RequestError
from pegainfer.ir.ops.penalties import Penalties
from pegainfer.runtime.constraint import AllowedTokens, Chain, PenaltyState, TokenConstraint
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.server.chat_output import ChatOutput
from pegainfer.server.errors import ApiError, ContextTooLong
from pegainfer.server.generation import TextOptions
from pegainfer.server.protocol import (ChatCompletionRequest, CompletionRequest, TokenizeRequest, _Sampling,
                                       unused_field_set)
from pegainfer.server.structured import GrammarSpec, after_reasoning, requested_spec
from pegainfer.server.tools import call_grammar, resolve_tool_choice

if TYPE_CHECKING:
    from pegainfer.server.app import ServerContext


@dataclass
class Prepared:
    """A validated request: its prompts as ids, and what each choice needs."""
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: list[SamplingParams]  # one per choice of each prompt
    text: TextOptions
    stop_token_ids: frozenset[int]
    # a fresh one per choice, from its prompt's ids: its grammar (structured outputs, tool calls), its penalties
    constraint: Callable[[list[int]], TokenConstraint] | None = None
    output: ChatOutput = ChatOutput()  # how a chat choice's text becomes its message
    score_only: bool = False  # max_tokens 0 with echo: the one token drawn is not answered
    lora: str | None = None  # the LoRA adapter the request's model names
    cache_salt: str | None = None
    echo_message: str = ""  # a chat answer's start with echo: the last message's content


# --- preparing a request -----------------------------------------------------------------------------------------

def check_model(ctx: "ServerContext", model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model); 404 for a name the server lacks."""
    if model is None or model == ctx.model_name:
        return None
    if model in ctx.lora_paths:
        return model
    raise ApiError(404, f"The model `{model}` does not exist; this server serves `{ctx.model_name}`"
                        f"{''.join(f', `{name}`' for name in ctx.lora_paths)}", "model", "model_not_found")


def check_ids(ctx: "ServerContext", ids: list[int], param: str) -> None:
    bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is out of range: the vocabulary has ids 0..{ctx.vocab_size - 1}",
                       param)


def check_common(ctx: "ServerContext", body: _Sampling, prompts: int) -> str | None:
    """The request's checks every route shares; returns the LoRA adapter its model names, if any."""
    lora = check_model(ctx, body.model)
    name = unused_field_set(body)
    if name is not None:
        raise ApiError(400, f"{name} is not supported by pegainfer yet: leave it out (set to "
                            f"{json.dumps(getattr(body, name))[:80]})", name)
    most = getattr(body, "max_completion_tokens", None) or getattr(body, "max_tokens", None)
    if most is not None and body.min_tokens > most:
        raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds the maximum ({most})", "min_tokens")
    if body.best_of not in (None, 1, body.n):
        raise ApiError(400, "best_of is not supported by pegainfer: leave it out or equal to n", "best_of")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
    if prompts * body.n > ctx.max_seqs_per_request:
        raise ApiError(400, f"this request asks for {prompts} prompts x n={body.n} = {prompts * body.n} sequences; "
                            f"this server takes at most {ctx.max_seqs_per_request} per request "
                            f"(--max-seqs-per-request): split it", "n" if body.n > 1 else "prompt")
    check_ids(ctx, body.stop_token_ids or [], "stop_token_ids")
    return lora


def resolve_max_tokens(ctx: "ServerContext", prompt_len: int, requested: int | None, param: str,
                       prompt_param: str) -> int:
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise ContextTooLong(f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} "
                             f"tokens, which leaves none to generate. Shorten the prompt.", prompt_param)
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise ContextTooLong(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                             f"completion). Reduce the prompt or {param}.", param)
    return requested


def sampling_params(ctx: "ServerContext", body: _Sampling, prompt_len: int, max_tokens: int | None,
                    max_tokens_param: str, prompt_param: str, logprobs: int | None) -> list[SamplingParams]:
    max_tokens = resolve_max_tokens(ctx, prompt_len, max_tokens, max_tokens_param, prompt_param)
    try:
        ctx.engine.scheduler.check(prompt_len, max_tokens)
    except RequestError as error:
        raise ApiError(400, str(error), prompt_param) from None
    given = {name: sampling_value(ctx, body, name) for name in ("temperature", "top_p", "top_k", "min_p")}
    return [SamplingParams(temperature=given["temperature"], top_p=given["top_p"], top_k=int(given["top_k"]),
                           min_p=given["min_p"],
                           seed=None if body.seed is None else (body.seed + j) % 2**63, logprobs=logprobs,
                           max_tokens=max_tokens, ignore_eos=body.ignore_eos, prompt_logprobs=prompt_logprobs(body),
                           min_tokens=body.min_tokens)
            for j in range(body.n)]


def sampling_value(ctx: "ServerContext", body: _Sampling, name: str) -> Any:
    """The request's value, or where it left the field out the checkpoint's default (generation_config.json)."""
    if name in body.model_fields_set:
        return getattr(body, name)
    return ctx.sampling_defaults.get(name, getattr(body, name))


def prompt_logprobs(body: _Sampling) -> int | None:
    """vLLM's prompt_logprobs, or a completion's echo with logprobs (the prompt's top-k as the output's)."""
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    echo = getattr(body, "echo", False)
    return body.logprobs if echo and getattr(body, "logprobs", None) is not None else None


async def prepare_completion(ctx: "ServerContext", body: CompletionRequest) -> Prepared:
    prompt = body.prompt
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt[0], str) else None
    id_prompts = None if texts is not None else [prompt] if isinstance(prompt[0], int) else prompt
    lora = check_common(ctx, body, len(texts if texts is not None else id_prompts))
    score_only = body.max_tokens == 0
    if score_only and (not body.echo or body.stream):
        raise ApiError(400, "max_tokens 0 scores the prompt: it needs echo, and is answered whole (no stream)",
                       "max_tokens")
    keep = truncation(ctx, body)
    if texts is not None:
        prompts = [await encode_prompt(ctx, text, "prompt", body.add_special_tokens, keep) for text in texts]
        if keep is not None and body.echo:  # the echo is what the model read: the kept tokens' text
            texts = [ctx.tokenizer.decode(ids) for ids in prompts]
    else:
        prompts = id_prompts if keep is None else [ids[-keep:] for ids in id_prompts]
        for ids in prompts:
            if len(ids) < ctx.max_model_len:  # longer ones are refused with their length below, unread
                check_ids(ctx, ids, "prompt")
        texts = [ctx.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    if any(not ids for ids in prompts):
        raise ApiError(400, "the prompt is empty: it encodes to no tokens", "prompt")
    params = []
    for ids in prompts:
        params += sampling_params(ctx, body, len(ids), 1 if score_only else body.max_tokens, "max_tokens", "prompt",
                                  body.logprobs)
    return Prepared(prompts, texts, params, text_options(body), frozenset(body.stop_token_ids or []),
                    await constraint_factory(ctx, body), score_only=score_only, lora=lora, cache_salt=body.cache_salt)


def text_options(body: _Sampling) -> TextOptions:
    return TextOptions(body.stop, body.include_stop_str_in_output, body.skip_special_tokens)


def truncation(ctx: "ServerContext", body: _Sampling) -> int | None:
    """How many of the prompt's last tokens truncate_prompt_tokens keeps (-1: the context length); None: all."""
    keep = body.truncate_prompt_tokens
    if keep == 0:
        raise ApiError(400, "truncate_prompt_tokens 0 would leave no prompt: give at least 1, or -1 for the "
                            "context length", "truncate_prompt_tokens")
    if keep is not None and keep > ctx.max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens ({keep}) exceeds this model's maximum context length "
                            f"({ctx.max_model_len})", "truncate_prompt_tokens")
    return ctx.max_model_len if keep == -1 else keep


async def encode_prompt(ctx: "ServerContext", text: str, param: str, specials: bool, keep: int | None) -> list[int]:
    """A prompt text's ids, with or without the tokenizer's added special tokens, its last `keep` where given."""
    if keep is None:
        ids = await ctx.encoder.encode(text, ctx.max_model_len - 1, param, ctx.max_model_len)
    else:
        ids = await ctx.encoder.encode_tail(text, keep)
    if specials:
        return ids if keep is None else ctx.tokenizer.keep_last(ids, keep)
    ids = ctx.tokenizer.without_added_specials(ids)
    return ids if keep is None else ids[-keep:]


def render_chat(ctx: "ServerContext", messages, add_generation_prompt: bool, kwargs: dict | None,
                continue_final: bool = False) -> str:
    if ctx.chat_template is None:
        raise ApiError(400, "this model's checkpoint has no chat template (tokenizer_config.json chat_template): "
                            "use /v1/completions", "messages")
    if continue_final and add_generation_prompt:
        raise ApiError(400, "continue_final_message continues the last message: set add_generation_prompt to "
                            "false with it", "continue_final_message")
    kwargs = kwargs or {}
    clash = {"messages", "add_generation_prompt"} & kwargs.keys()
    if clash:
        raise ApiError(400, f"chat_template_kwargs may not set {sorted(clash)[0]}", "chat_template_kwargs")
    inputs = [m.as_template_input() for m in messages]
    try:
        text = ctx.chat_template.render(inputs, add_generation_prompt=add_generation_prompt, **kwargs)
    except RequestError as error:
        raise ApiError(400, str(error), "messages") from None
    return open_final_message(text, inputs[-1]["content"]) if continue_final else text


def template_kwargs(body: ChatCompletionRequest | TokenizeRequest, tools: list | None) -> dict[str, Any]:
    """What the chat template reads beside the messages: the tools (checked), documents, chat_template_kwargs."""
    return ({"tools": tools} if tools else {}) | \
        ({"documents": body.documents} if body.documents is not None else {}) | (body.chat_template_kwargs or {})


def open_final_message(text: str, final: str) -> str:
    """The rendered chat cut just after the last message's content (continue_final_message: the answer goes on
    with it), as transformers cuts it: where the template kept the content's leading spaces, with them."""
    if not final.strip():
        raise ApiError(400, "continue_final_message needs a last message with text to continue", "messages")
    at = text.rfind(final.strip())
    if at < 0:
        raise ApiError(400, "continue_final_message: the chat template does not write the last message's content "
                            "as it is, so there is no place to continue it", "messages")
    kept = final.lstrip()
    return text[:at + len(kept)] if text[at:at + len(kept)] == kept else text[:at + len(final.strip())]


def echoed_message(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content, where it has the answer's role (the assistant's, or with no
    generation prompt the last message's own)."""
    last = body.messages[-1]
    if not body.echo or (body.add_generation_prompt and last.role != "assistant"):
        return ""
    return last.as_template_input()["content"]


async def prepare_chat(ctx: "ServerContext", body: ChatCompletionRequest) -> Prepared:
    lora = check_common(ctx, body, 1)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    choice = resolve_tool_choice(body.tools, body.tool_choice, body.parallel_tool_calls,
                                 ctx.auto_tool_choice and ctx.tool_call_parser is not None)
    kwargs = template_kwargs(body, body.tools if choice.functions else None)
    text = render_chat(ctx, body.messages, body.add_generation_prompt, kwargs, body.continue_final_message)
    # the template writes its own special tokens (a BOS), as vLLM's chat has it, unless add_special_tokens
    ids = await encode_prompt(ctx, text, "messages", body.add_special_tokens, truncation(ctx, body))
    if not ids:
        raise ApiError(400, "the messages render to an empty prompt", "messages")
    name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = sampling_params(ctx, body, len(ids), body.max_completion_tokens or body.max_tokens, name,
                             "messages", (body.top_logprobs or 0) if body.logprobs else None)
    calls = call_grammar(choice, ctx.tool_call_parser or "")
    output = ChatOutput(ctx.reasoning_parser, ctx.tool_call_parser if choice.mode != "none" else None,
                        choice.mode == "named")
    thinking = (body.chat_template_kwargs or {}).get("enable_thinking") is not False  # the template's default: on
    # a continued last message is past the template's thinking block: the answer's constraint holds from its start
    thinking = thinking and ctx.reasoning_parser is not None and not body.continue_final_message
    return Prepared([ids], [text], params, text_options(body), frozenset(body.stop_token_ids or []),
                    await constraint_factory(ctx, body, calls, ctx.reasoning_parser if thinking else None), output,
                    lora=lora, cache_salt=body.cache_salt, echo_message=echoed_message(body))


async def constraint_factory(ctx: "ServerContext", body: _Sampling, calls: GrammarSpec | None = None,
                             reasoning: str | None = None) -> Callable[[list[int]], TokenConstraint] | None:
    """The maker of a choice's constraint: the request's structured output or required tool calls (after the
    reasoning, where the model thinks), compiled off the event loop (a first grammar builds the tokenizer's
    tables), or its allowed_token_ids; and its penalties; None when it has none."""
    spec = requested_spec(body)
    if spec is not None and calls is not None:
        raise ApiError(400, f"{spec.param} and tool_choice {body.tool_choice!r} both constrain the output: "
                            f"choose one", spec.param)
    spec = spec or calls
    stops = sorted(ctx.tokenizer.eos_token_ids | set(body.stop_token_ids or []))
    allowed = allowed_tokens(ctx, body.allowed_token_ids, body.min_tokens, set(stops))
    if allowed is not None and spec is not None:  # a grammar's mask and the list could leave no id at all
        raise ApiError(400, f"allowed_token_ids and {spec.param} both constrain the output: choose one",
                       "allowed_token_ids")
    if spec is not None and reasoning is not None:  # the model thinks freely first
        spec = after_reasoning(spec, reasoning)
    grammar = None if spec is None else await asyncio.to_thread(ctx.grammars.constraint_factory, spec)
    penalties = request_penalties(ctx, body)
    if grammar is None and allowed is None and not penalties.active:
        return None

    def make(prompt_ids: list[int]) -> TokenConstraint:
        parts = [PenaltyState(penalties, prompt_ids, ctx.vocab_size, stops)] if penalties.active else []
        limits = [grammar()] if grammar is not None else [allowed] if allowed is not None else []
        return Chain(*parts, *limits)
    return make


def allowed_tokens(ctx: "ServerContext", ids: list[int] | None, min_tokens: int,
                   stops: set[int]) -> AllowedTokens | None:
    """The request's allowed_token_ids as a fixed mask (immutable: its choices share it)."""
    if ids is None:
        return None
    check_ids(ctx, ids, "allowed_token_ids")
    if min_tokens and set(ids) <= stops:
        raise ApiError(400, f"allowed_token_ids holds only stop tokens, which min_tokens ({min_tokens}) forbids "
                            f"at first: no token could be drawn", "allowed_token_ids")
    return AllowedTokens(ids, ctx.vocab_size)


def request_penalties(ctx: "ServerContext", body: _Sampling) -> Penalties:
    """The request's penalties, its logit_bias's ids checked against the vocabulary."""
    bias = []
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, found {key!r}", "logit_bias") from None
        if not 0 <= token < ctx.vocab_size or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias maps token ids in [0, {ctx.vocab_size}) to biases in [-100, 100], "
                                f"found {key}: {value}", "logit_bias")
        bias.append((token, float(value)))
    return Penalties(body.presence_penalty, body.frequency_penalty, sampling_value(ctx, body, "repetition_penalty"),
                     tuple(bias), body.min_tokens, bad_word_ids(ctx, body.bad_words or []))


def bad_word_ids(ctx: "ServerContext", words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences, as vLLM makes them: the word as written and after a space (its spelling
    inside a sentence); a word that encodes to nothing is refused."""
    sequences = []
    for word in words:
        for spelling in dict.fromkeys((word, " " + word.lstrip())):
            ids = tuple(ctx.tokenizer.without_added_specials(ctx.tokenizer.encode(spelling)))
            if not ids:
                raise ApiError(400, f"bad_words: {word!r} encodes to no tokens", "bad_words")
            sequences.append(ids)
    return tuple(dict.fromkeys(sequences))
