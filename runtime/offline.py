"""One prompt in, one completion out: what `pegainfer generate` does, as a function that returns plain data."""

from dataclasses import replace
from pathlib import Path
from typing import Any

from pegainfer.errors import RequestError
from pegainfer.frontends.load import load_model
from pegainfer.runtime.device import choose_device
from pegainfer.runtime.generate import Request, generate
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.tokenizer import check_prompt_ids, eos_token_ids, load_tokenizer


def generate_one(model_path: Path, params: SamplingParams, *, prompt: str | None = None,
                 prompt_ids: list[int] | None = None, device: str | None = None) -> dict[str, Any]:
    """Returns {device, device_reason, prompt_token_ids, token_ids, text, finish_reason, logprobs}."""
    assert (prompt is None) != (prompt_ids is None), "give exactly one of prompt and prompt_ids"
    params.validate()
    device, reason = choose_device(device)
    model = load_model(model_path, lazy=device == "cuda")
    tokenizer = load_tokenizer(model_path) if prompt is not None or (model_path / "tokenizer.json").is_file() \
        else None
    ids = tokenizer.encode(prompt) if prompt is not None else list(prompt_ids)
    check_prompt_ids(ids, model.spec.config.vocab_size)
    max_model_len = model.spec.raw_config.get("max_position_embeddings")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens; this model takes at most {max_model_len - 1} "
                           f"(max_position_embeddings {max_model_len})")
    if max_model_len is not None:
        params = replace(params, max_tokens=min(params.max_tokens, max_model_len - len(ids)))
    engine = _engine(model, device, len(ids) + params.max_tokens)
    eos = tokenizer.eos_token_ids if tokenizer else eos_token_ids(model_path)
    (completion,) = generate(engine, [Request(ids, params)], eos)
    return {
        "device": device,
        "device_reason": reason,
        "prompt_token_ids": ids,
        "token_ids": completion.token_ids,
        "text": tokenizer.decode(completion.token_ids) if tokenizer else None,
        "finish_reason": completion.finish_reason,
        "logprobs": None if completion.logprobs is None else
        [{str(token): logprob for token, logprob in step.items()} for step in completion.logprobs],
    }


def _engine(model, device: str, tokens: int):
    if device == "cpu":
        return ReferenceEngine(model, max_tokens=tokens)
    from pegainfer.backends.cache import cache_root, manifest_path
    from pegainfer.runtime.device import visible_sm
    from pegainfer.runtime.gpu.engine import EngineOptions, GpuEngine, missing_manifest

    manifest = manifest_path(cache_root(), visible_sm(), model.spec)
    if not manifest.is_file():
        raise missing_manifest(manifest, str(model.folder))
    options = EngineOptions(max_tokens=max(tokens, 16), max_batch=8, max_model_len=tokens + 16, kv_tokens=tokens + 16)
    return GpuEngine(model, manifest, options)

