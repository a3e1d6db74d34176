"""A draft head's checkpoint for speculative decoding (its DAG file declares DRAFTER_ARCHITECTURES): config.json and
safetensors checked against the head's graphs, beside the target it drafts for (the same vocabulary, the hidden
size it was trained on); the embedding is the target's."""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path

import numpy as np
from safetensors import safe_open

from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.frontends.checkpoint import check_weights, load_weights, scan_checkpoint
from pegainfer.frontends.config import architecture_of, parse_config, read_config
from pegainfer.frontends.load import LoadedModel, ModelSpec
from pegainfer.frontends.registry import drafter_modules
from pegainfer.ir.graph import REPEAT, Graph


@dataclass
class HeadGraphs:
    """A head's graphs and the target layers it reads, from its config.json alone (what compiling needs)."""
    spec: ModelSpec  # its `graph` is the one over the target's features; `dag`, the head's DAG file
    next: Graph  # over its own output
    target_layers: list[int]  # the target layers whose input it reads


@dataclass
class DraftHead:
    first: Graph
    next: Graph
    weights: Mapping[str, np.ndarray]
    to_target: np.ndarray | None  # draft id -> target id, where its vocabulary is smaller
    target_layers: list[int]
    spec: ModelSpec  # its graph `first`
    from_target: frozenset[str]  # the params that are the target's (its embedding): a GPU borrows them


class LentWeights(Mapping):
    """A head's own tensors, and the target's `lent` ones read from the target's (lazy) weights only when asked:
    a GPU engine that borrows them from the target's never reads them on the host."""

    def __init__(self, own: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray], lent: frozenset[str]) -> None:
        self.own, self.target, self.lent = own, target, lent - set(own)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.lent:
            return self.target[name]
        return self.own[name]

    def __iter__(self) -> Iterator[str]:
        return chain(self.own, self.lent)

    def __len__(self) -> int:
        return len(self.own) + len(self.lent)


def head_graphs(folder: Path, target: ModelSpec) -> HeadGraphs:
    """The head's graphs for `target` (the same vocabulary, the hidden size it was trained on), else one line."""
    config_path = folder / "config.json"
    source = str(config_path)
    raw = read_config(config_path)
    architecture = architecture_of(raw, source)
    module = drafter_modules().get(architecture)
    if module is None:
        raise ConfigError(f"{source}: {architecture!r} is not a draft head pegainfer runs; known: "
                          f"{', '.join(sorted(drafter_modules()))}")
    config = replace(parse_config(module.Config, raw, source), torch_dtype=target.config.torch_dtype)
    module.check_config(config)
    _check_target(config, target, source)
    first, next_graph = module.build_graphs(config)
    spec = ModelSpec(config_path, raw, architecture, module, config, first)
    return HeadGraphs(spec, next_graph, module.aux_layers(config, _decoder_layers(target)))


def load_draft_head(folder: Path, target: LoadedModel) -> DraftHead:
    head = head_graphs(folder, target.spec)
    source = str(folder / "config.json")
    tensors = scan_checkpoint(folder)
    first, lent = head.spec.graph, frozenset({head.spec.dag.EMBEDDING})
    own = {name: t for name, t in {**first.checkpoint_params(), **head.next.checkpoint_params()}.items()
           if name not in lent}
    check_weights(own, tensors, folder)
    weights = LentWeights(load_weights(own, tensors), target.weights, lent)
    return DraftHead(first, head.next, weights, _vocabulary_map(tensors, head.spec.config, source),
                     head.target_layers, head.spec, lent)


def _check_target(config, target: ModelSpec, source: str) -> None:
    vocab, hidden = target.config.vocab_size, target.config.hidden_size
    if config.vocab_size != vocab:
        raise ConfigError(f"{source}: the head's vocabulary has {config.vocab_size} tokens, the target's {vocab}: "
                          f"a head drafts for the model it was trained on")
    if config.target_hidden != hidden:
        raise ConfigError(f"{source}: the head reads hidden states of {config.target_hidden}, the target's are "
                          f"{hidden}")


def _decoder_layers(target: ModelSpec) -> int:
    return sum(n.attrs["count"] * n.attrs.get("layers", 1) for n in target.graph.nodes if n.op == REPEAT)


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
