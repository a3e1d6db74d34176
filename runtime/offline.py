"""One prompt in, one completion out: what `pegainfer generate` does, as a function that returns plain data."""

from pathlib import Path
from typing import Any

from pegainfer.errors import RequestError
from pegainfer.frontends.hub import resolve_checkpoint
from pegainfer.frontends.load import LoadedModel, load_model
from pegainfer.passes.shard import Parallelism
from pegainfer.runtime.detokenize import decode_completion
from pegainfer.runtime.device import choose_device
from pegainfer.runtime.drafter_graphs import drafting_target
from pegainfer.runtime.generate import Request, generate
from pegainfer.runtime.rank_workers import Ranks, RankSpec
from pegainfer.runtime.proposers import make_speculator
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.sharded_engine import start_sharded_engine
from pegainfer.runtime.speculative import parse_speculative_config
from pegainfer.runtime.tokenizer import check_prompt_ids, eos_token_ids, load_tokenizer


def generate_one(model_path: Path | str, params: SamplingParams, *, prompt: str | None = None,
                 prompt_ids: list[int] | None = None, device: str | None = None, dtype: str = "auto",
                 cache_dir: Path | None = None, quantization: str | None = None,
                 kv_cache_dtype: str = "auto", parallel: Ranks = Ranks(),
                 speculative: str | None = None) -> dict[str, Any]:
    """Returns {device, device_reason, dtype, prompt_token_ids, token_ids, text, finish_reason, logprobs}.
    `model_path`: a checkpoint folder or a Hugging Face id; `dtype`: load_spec's; `cache_dir`: the cubin cache
    for cuda (cache_root's rule), where missing kernels are compiled when a compiler is installed; `parallel`: the
    model sharded over that many processes (runtime/sharded_engine.py); `speculative`: a --speculative-config
    JSON."""
    assert (prompt is None) != (prompt_ids is None), "give exactly one of prompt and prompt_ids"
    params.validate()
    config = parse_speculative_config(speculative) if speculative else None
    device, reason = choose_device(device)
    folder = resolve_checkpoint(model_path).folder
    sharding = Parallelism(parallel.size, 0, parallel.expert_parallel)
    model = load_model(folder, lazy=device == "cuda" or sharding.sharded, dtype=dtype, device=device,
                       quantization=quantization, kv_cache_dtype=kv_cache_dtype, parallel=sharding)
    model = drafting_target(config, model, device, sharding.sharded)
    tokenizer = load_tokenizer(folder) if prompt is not None or (folder / "tokenizer.json").is_file() else None
    ids = tokenizer.encode(prompt) if prompt is not None else list(prompt_ids)
    check_prompt_ids(ids, model.spec.config.vocab_size)
    max_model_len = model.spec.raw_config.get("max_position_embeddings")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens; this model takes at most {max_model_len - 1} "
                           f"(max_position_embeddings {max_model_len})")
    reach = len(ids) + params.max_tokens  # the most tokens the sequence can hold: what the KV pool is sized for
    tokens = min(reach, max_model_len or reach)
    spares = int(config is not None)  # a speculating sequence's recurrent state to roll back to
    drafts = config.num_speculative_tokens if config else 0
    engine = _engine(model, device, tokens, cache_dir, spares, drafts) if not sharding.sharded else \
        start_sharded_engine(RankSpec(str(folder), parallel.size, parallel.expert_parallel, dtype, device, quantization,
                                      kv_cache_dtype, tokens, max_seqs=1, spare_states=spares,
                                      gpu=_gpu_options(tokens, spares, drafts) if device == "cuda" else None,
                                      cache_dir=cache_dir and str(cache_dir)), parallel.backend, model)
    eos = tokenizer.eos_token_ids if tokenizer else eos_token_ids(folder)
    speculator = config and make_speculator(config, model, device, tokens, 1, dtype, engine, cache_dir)
    try:
        (completion,) = generate(engine, [Request(ids, params)], eos, max_model_len=max_model_len,
                                 speculator=speculator)
    finally:
        if sharding.sharded:
            engine.shutdown()
    return {
        "device": device,
        "device_reason": reason,
        "dtype": model.spec.config.torch_dtype,
        "prompt_token_ids": ids,
        "token_ids": completion.token_ids,
        "text": decode_completion(tokenizer, ids, completion.token_ids) if tokenizer else None,
        "finish_reason": completion.finish_reason,
        "logprobs": None if completion.logprobs is None else
        [{str(token): logprob for token, logprob in step.items()} for step in completion.logprobs],
    }


def _engine(model: LoadedModel, device: str, tokens: int, cache_dir: Path | None, spares: int, drafts: int):
    if device == "cpu":
        return ReferenceEngine(model, max_tokens=tokens, max_seqs=1, spare_states=spares)
    from pegainfer.runtime.gpu.start import gpu_engine

    return gpu_engine(model, _gpu_options(tokens, spares, drafts), cache_dir)


def _gpu_options(tokens: int, spares: int = 0, drafts: int = 0):
    """The GPU engine's sizes for one sequence that reaches `tokens` tokens (and verifies `drafts` at a time)."""
    from pegainfer.runtime.gpu.engine import EngineOptions

    return EngineOptions(max_tokens=max(tokens, 16), max_batch=8, max_model_len=tokens + 16, kv_tokens=tokens + 16,
                         spare_states=spares, max_samples=8 * (drafts + 1), verify_tokens=drafts and drafts + 1)
