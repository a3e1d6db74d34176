"""Multimodal checkpoints (`<Model>ForConditionalGeneration`) served by their text stack: the text model's
settings are config.json's `text_config`, its weights sit under a language-model prefix, and the vision tower's
weights are left unread. A DAG file names the wrappers it serves in WRAPPERS (wrapper architecture -> the
wrapper's model_type); requests with images are refused by the server."""

from types import ModuleType
from typing import Any

from pegainfer.errors import ConfigError
from pegainfer.frontends.checkpoint import TensorInfo
from pegainfer.frontends.config import normalize_hf_config

# Where wrappers keep the text stack's weights, as prefixes of the text-only model's names: transformers 5 writes
# model.language_model.*, checkpoints saved by 4.x language_model.model.* and language_model.lm_head.
PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."))
# Top-level keys a wrapper's text stack reads when its text_config lacks them.
INHERITED = ("torch_dtype", "dtype", "tie_word_embeddings", "quantization_config")


def text_stack_config(raw: dict[str, Any], dag: ModuleType, source: str) -> dict[str, Any]:
    """config.json of a wrapper as the text-only model's: its text_config over the DAG file's defaults for keys a
    published text_config leaves out (TEXT_DEFAULTS), with the top-level keys it inherits."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a {raw['architectures'][0]} checkpoint needs a 'text_config' object, "
                          f"found {type(text).__name__}")
    model_type = text.get("model_type", dag.MODEL_TYPE)
    if model_type != dag.MODEL_TYPE:
        raise ConfigError(f"{source}: text_config's model_type must be {dag.MODEL_TYPE!r}, found {model_type!r}")
    config = {**getattr(dag, "TEXT_DEFAULTS", {}), **{k: raw[k] for k in INHERITED if k in raw}, **text}
    if "tie_word_embeddings" in raw:  # the wrapper's own setting is the one transformers ties by
        config["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return normalize_hf_config({**config, "architectures": [dag.ARCHITECTURES[0]], "model_type": dag.MODEL_TYPE})


def text_stack_tensors(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The checkpoint's text-stack tensors under the text-only model's names (each still read by its own name)."""
    renamed = {}
    for name, info in tensors.items():
        for prefix, replacement in PREFIXES:
            if name.startswith(prefix):
                renamed[replacement + name[len(prefix):]] = TensorInfo(info.file, info.shape, info.dtype,
                                                                       info.offset, info.nbytes, name)
                break
        else:
            if name == "lm_head.weight":
                renamed[name] = info
    return renamed
