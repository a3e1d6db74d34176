"""`pegainfer bench serve`: an async load generator for any OpenAI-compatible server. It streams every request,
timestamps each content chunk, and reports request and token throughput, TTFT, TPOT and inter-token latency.

TTFT: request sent to first content chunk. TPOT: (latency - TTFT) / (output tokens - 1), per request. ITL: the gaps
between a request's consecutive content chunks (a chunk may carry several tokens). Output tokens come from the
server's usage when it reports it (stream_options.include_usage), else from the chunks counted.
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pegainfer.errors import PegainferError

if TYPE_CHECKING:
    from pegainfer.runtime.tokenizer import TextTokenizer

FIT_ROUNDS = 64  # decode, encode, cut or pad: rounds before giving up on a prompt of the exact length


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    input_len: int = 1024
    output_len: int = 128
    num_prompts: int = 100
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0
    tokenizer: Path | None = None
    api_key: str | None = None
    ignore_eos: bool = True  # vLLM's extension; servers that refuse unknown fields (transformers serve) need False


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)


def random_prompts(config: BenchConfig) -> list[list[int] | str]:
    """`num_prompts` prompts of `input_len` random token ids. Without a tokenizer the ids are the 1000 past the
    byte range, which every real vocabulary has; with one, any of its whole tokens, as text that encodes back to
    exactly `input_len` tokens (fit_prompt), so the server counts the prompt tokens asked for (on
    /v1/chat/completions, the chat template's own tokens come on top)."""
    rng = np.random.default_rng(config.seed)
    if config.tokenizer is None:
        return rng.integers(256, 1256, (config.num_prompts, config.input_len)).tolist()
    from pegainfer.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer)
    pool = whole_tokens(tokenizer)
    return [fit_prompt(tokenizer, rng.choice(pool, config.input_len).tolist(), config.input_len, pool, rng)
            for _ in range(config.num_prompts)]


def whole_tokens(tokenizer: "TextTokenizer") -> np.ndarray:
    """The ordinary tokens whose text encodes back to that token alone: no special token, no part of a character
    (random ids of those decode to U+FFFD, which re-encodes to three bytes)."""
    inner = tokenizer.tokenizer
    ids = list(range(inner.get_vocab_size(with_added_tokens=False)))
    texts = inner.decode_batch([[i] for i in ids], skip_special_tokens=True)
    encodings = inner.encode_batch(texts, add_special_tokens=False)
    pool = np.array([i for i, encoding in zip(ids, encodings) if encoding.ids == [i]], dtype=np.int64)
    if not pool.size:
        raise PegainferError("--tokenizer: no token of this tokenizer encodes back to itself from its text, so no "
                             "random prompt of an exact length can be made with it")
    return pool


def fit_prompt(tokenizer: "TextTokenizer", ids: list[int], length: int, pool: np.ndarray,
               rng: np.random.Generator) -> str:
    """Text that encodes (as the server encodes a prompt: special tokens included) to exactly `length` tokens,
    as SGLang's and vLLM's random datasets make it: decode the ids, encode the text, cut the excess or add random
    tokens of `pool`, decode again, until the count holds. Decoded random ids alone re-encode to other counts:
    neighbours merge, and a byte-level BPE's partial characters come back as U+FFFD's three bytes."""
    from pegainfer.runtime.detokenize import REPLACEMENT

    added = len(tokenizer.encode(""))
    if length < added:
        raise PegainferError(f"--input-len {length}: this tokenizer adds {added} special tokens to every prompt, "
                             f"so no prompt has fewer")
    for _ in range(FIT_ROUNDS):
        text = tokenizer.decode(ids)
        excess = len(tokenizer.encode(text)) - length
        if excess == 0:
            return text
        ids = tokenizer.encode(text, add_special_tokens=False)
        if excess < 0:
            ids += rng.choice(pool, -excess).tolist()
            continue
        del ids[max(len(ids) - excess, 0):]
        while ids and tokenizer.decode(ids).endswith(REPLACEMENT):  # a cut inside a character: back to its start
            ids.pop()
    raise PegainferError(f"--input-len {length}: found no text that this tokenizer encodes to exactly {length} "
                         f"tokens in {FIT_ROUNDS} rounds; try another --input-len or --seed")


def request_body(config: BenchConfig, prompt: list[int] | str) -> dict:
    body = {"model": config.model, "max_tokens": config.output_len, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}, **({"ignore_eos": True} if config.ignore_eos else {})}
    if config.endpoint.endswith("chat/completions"):
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        return {**body, "messages": [{"role": "user", "content": text}]}
    return {**body, "prompt": prompt}


async def one_request(client, config: BenchConfig, prompt: list[int] | str) -> Result:
    result, chunks = Result(), 0
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    started = last = time.perf_counter()
    try:
        async with client.stream("POST", config.base_url + config.endpoint, json=request_body(config, prompt),
                                 headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[5:])
                if "error" in payload:
                    result.error = json.dumps(payload["error"])[:300]
                    return result
                if payload.get("usage"):
                    result.output_tokens = payload["usage"]["completion_tokens"]
                    result.prompt_tokens = payload["usage"]["prompt_tokens"]
                for choice in payload.get("choices", []):
                    if not (choice.get("text") or (choice.get("delta") or {}).get("content") or
                            choice.get("finish_reason")):
                        continue  # a chunk with no text: a server holding back part of a character sends none
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
    except Exception as error:  # noqa: BLE001  any transport failure is one failed request, reported
        cause = f", from {error.__cause__!r}" if error.__cause__ else ""  # httpx's ReadError says nothing itself
        said = f": {error}" if str(error) else ""
        result.error = f"{type(error).__name__}{said} ({time.perf_counter() - started:.2f} s in, {chunks} chunks " \
                       f"read{cause})"
        return result
    result.latency = time.perf_counter() - started
    result.output_tokens = result.output_tokens or chunks
    result.prompt_tokens = result.prompt_tokens or config.input_len
    result.ok = chunks > 0  # as vLLM's benchmark: a stream that ended without error, whatever its text
    result.error = "" if result.ok else "the stream ended with no choice in it"
    return result


async def run_bench(config: BenchConfig) -> dict:
    import httpx

    prompts = random_prompts(config)
    rng = np.random.default_rng(config.seed + 1)
    gaps = rng.exponential(1 / config.request_rate, len(prompts)) if np.isfinite(config.request_rate) \
        else np.zeros(len(prompts))
    limit = asyncio.Semaphore(config.max_concurrency or len(prompts))
    connections = config.max_concurrency or len(prompts)

    async def limited(client, prompt) -> Result:
        async with limit:
            return await one_request(client, config, prompt)

    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=connections)) as client:
        started = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(client, prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - started
    return summarize(config, results, duration)


def summarize(config: BenchConfig, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    inputs = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report = {
        "base_url": config.base_url, "endpoint": config.endpoint, "model": config.model,
        "input_len": config.input_len, "output_len": config.output_len, "num_prompts": config.num_prompts,
        "request_rate": None if not np.isfinite(config.request_rate) else config.request_rate,
        "max_concurrency": config.max_concurrency, "completed": len(ok), "duration_s": duration,
        "total_input_tokens": inputs, "total_output_tokens": output,
        "request_throughput": len(ok) / duration, "output_throughput": output / duration,
        "total_token_throughput": (output + inputs) / duration,
        "errors": [r.error for r in results if not r.ok][:10],
    }
    for name, values in (("ttft_ms", [r.ttft for r in ok]), ("tpot_ms", tpot),
                         ("itl_ms", [gap for r in ok for gap in r.itl])):
        array = np.array(values, dtype=np.float64) * 1000
        for stat, fn in (("mean", np.mean), ("p50", np.median), ("p99", lambda a: np.percentile(a, 99))):
            report[f"{stat}_{name}"] = float(fn(array)) if array.size else None
    return report


def format_report(report: dict) -> str:
    def number(value) -> str:
        return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)

    rows = [("Successful requests", report["completed"]), ("Benchmark duration (s)", report["duration_s"]),
            ("Total input tokens", report["total_input_tokens"]),
            ("Total output tokens", report["total_output_tokens"]),
            ("Request throughput (req/s)", report["request_throughput"]),
            ("Output token throughput (tok/s)", report["output_throughput"]),
            ("Total token throughput (tok/s)", report["total_token_throughput"])]
    for name, label in (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)")):
        rows += [(f"{stat.capitalize()} {label}", report[f"{stat}_{name}"]) for stat in ("mean", "p50", "p99")]
    title = (f" Serving benchmark: {report['model']} at {report['base_url']}{report['endpoint']}, "
             f"{report['num_prompts']} x ({report['input_len']} in, {report['output_len']} out), concurrency "
             f"{report['max_concurrency'] or 'unlimited'} ")
    width = max(len(title), 50)
    return "\n".join([title.center(width, "="), *(f"{label:<40}{number(value):>{width - 40}}"
                                                  for label, value in rows), "=" * width]) + "\n"
