"""A draft head's checkpoint for speculative decoding (its DAG file declares DRAFTER_ARCHITECTURES): config.json and
safetensors checked against the head's graphs, beside the target it drafts for (the same vocabulary, the hidden
size it was trained on); the embedding is the target's."""

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from safetensors import safe_open

from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.frontends.checkpoint import check_weights, load_weights, scan_checkpoint
from pegainfer.frontends.config import architecture_of, parse_config, read_config
from pegainfer.frontends.load import LoadedModel
from pegainfer.frontends.registry import drafter_modules
from pegainfer.ir.graph import REPEAT, Graph


@dataclass
class DraftHead:
    first: Graph  # reads the target's features
    next: Graph  # reads its own output
    weights: dict[str, np.ndarray]
    to_target: np.ndarray | None  # draft id -> target id, where its vocabulary is smaller
    target_layers: list[int]  # the target layers whose input it reads


def load_draft_head(folder: Path, target: LoadedModel) -> DraftHead:
    source = str(folder / "config.json")
    raw = read_config(folder / "config.json")
    architecture = architecture_of(raw, source)
    module = drafter_modules().get(architecture)
    if module is None:
        raise ConfigError(f"{source}: {architecture!r} is not a draft head pegainfer runs; known: "
                          f"{', '.join(sorted(drafter_modules()))}")
    config = replace(parse_config(module.Config, raw, source), torch_dtype=target.spec.config.torch_dtype)
    module.check_config(config)
    _check_target(config, target, source)
    first, next_graph = module.build_graphs(config)
    tensors = scan_checkpoint(folder)
    own = {name: t for name, t in {**first.checkpoint_params(), **next_graph.checkpoint_params()}.items()
           if name != module.EMBEDDING}
    check_weights(own, tensors, folder)
    weights = load_weights(own, tensors) | {module.EMBEDDING: _target_embedding(target)}
    layers = module.aux_layers(config, _decoder_layers(target))
    return DraftHead(first, next_graph, weights, _vocabulary_map(tensors, config, source), layers)


def _check_target(config, target: LoadedModel, source: str) -> None:
    vocab, hidden = target.spec.config.vocab_size, target.spec.config.hidden_size
    if config.vocab_size != vocab:
        raise ConfigError(f"{source}: the head's vocabulary has {config.vocab_size} tokens, the target's {vocab}: "
                          f"a head drafts for the model it was trained on")
    if config.target_hidden != hidden:
        raise ConfigError(f"{source}: the head reads hidden states of {config.target_hidden}, the target's are "
                          f"{hidden}")


def _target_embedding(target: LoadedModel) -> np.ndarray:
    embedding = next(n for n in target.spec.graph.nodes if n.op == "embedding")
    return np.asarray(target.weights[embedding.inputs[1]])


def _decoder_layers(target: LoadedModel) -> int:
    return sum(n.attrs["count"] * n.attrs.get("layers", 1) for n in target.spec.graph.nodes if n.op == REPEAT)


def _vocabulary_map(tensors: dict, config, source: str) -> np.ndarray | None:
    """EAGLE-3's d2t (an offset a draft id adds to become the target's), or None where the vocabularies match."""
    if config.draft_vocab == config.vocab_size:
        return None
    info = tensors.get("d2t")
    if info is None or info.shape != (config.draft_vocab,):
        raise CheckpointError(f"{source}: a draft vocabulary of {config.draft_vocab} tokens needs 'd2t' "
                              f"[{config.draft_vocab}], found {None if info is None else list(info.shape)}")
    with safe_open(info.file, framework="numpy") as handle:
        offsets = handle.get_tensor("d2t").astype(np.int64)
    ids = np.arange(config.draft_vocab) + offsets
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise CheckpointError(f"{source}: d2t maps draft ids outside the target's vocabulary 0..{config.vocab_size - 1}")
    return ids
