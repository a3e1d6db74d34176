"""Proposers of draft tokens for speculative decoding (runtime/speculative.py): n-gram prompt lookup, which needs
no weights, and a draft model, a smaller model of the same vocabulary that drafts greedily on an engine of its own
with its own KV cache, kept in step with each target sequence's accepted tokens."""

from collections.abc import Sequence as Seq

import numpy as np

from pegainfer.errors import ConfigError
from pegainfer.frontends.drafter_load import load_draft_head
from pegainfer.frontends.checkpoint import derive_weights
from pegainfer.frontends.features import with_final_hidden, with_layer_inputs
from pegainfer.frontends.hub import resolve_checkpoint
from pegainfer.frontends.load import LoadedModel, load_model
from pegainfer.ir.step import has_recurrent_state
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.drafters import FeatureDrafter
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.speculative import DraftRequest, SpeculativeConfig, Speculator, ngram_drafts


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.shortest, self.longest = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        return [ngram_drafts(r.tokens, r.k, self.shortest, self.longest) for r in requests]

    def release(self, seq_id: int) -> None:
        pass


class DraftModelProposer:
    """`engine` (a ReferenceEngine or GpuEngine of the draft model) steps the draft sequences: first each one's
    tokens not yet in its cache (the whole prompt the first time, then the target's newly accepted tokens), then
    one token a step, the argmax drawn each time."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seqs: dict[int, Sequence] = {}

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        seqs = [self._follow(r) for r in requests]
        active = [i for i, r in enumerate(requests) if r.k > 0]
        while active:
            chunks = [Chunk(seqs[i], len(seqs[i].token_ids) - seqs[i].num_cached) for i in active]
            for i, row in zip(active, self.engine.step(chunks)):
                token = int(np.argmax(row))
                drafts[i].append(token)
                seqs[i].token_ids.append(token)
            active = [i for i in active if len(drafts[i]) < requests[i].k]
        return drafts

    def release(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.engine.release(seq)

    def _follow(self, request: DraftRequest) -> Sequence:
        """The draft sequence made to hold the target's tokens, its cache kept as far as they agree."""
        seq = self.seqs.setdefault(request.seq_id, Sequence(request.seq_id, []))
        agree = 0
        for mine, theirs in zip(seq.token_ids, request.tokens):
            if mine != theirs:
                break
            agree += 1
        seq.num_cached = min(seq.num_cached, agree, len(request.tokens) - 1)
        seq.token_ids = list(request.tokens)
        return seq


def make_speculator(config: SpeculativeConfig, target: LoadedModel, device: str, kv_tokens: int,
                    max_seqs: int, dtype: str = "auto", engine: ReferenceEngine | None = None) -> Speculator:
    """The proposer a config names, its draft model loaded beside the target (same vocabulary, else one line); a
    head that reads the target's hidden states has `engine` (the target's) give them from now on."""
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config))
    if device != "cpu":
        raise ConfigError(f"--speculative-config: method {config.method} runs on the CPU engine for now (its "
                          f"drafter's GPU engine is not wired yet); on cuda use ngram")
    draft_tokens = kv_tokens + max_seqs * config.num_speculative_tokens
    if config.method == "eagle3":
        head = load_draft_head(resolve_checkpoint(config.model).folder, target)
        if engine is not None:
            engine.graph = with_layer_inputs(engine.graph, head.target_layers)
        to_target = (lambda ids: ids) if head.to_target is None else head.to_target.__getitem__
        return Speculator(config, FeatureDrafter(head.first, head.next, head.weights, draft_tokens,
                                                 to_target=to_target))
    if config.method == "mtp":
        return Speculator(config, mtp_drafter(target, draft_tokens, engine))
    draft = load_model(resolve_checkpoint(config.model).folder, dtype=dtype, device=device)
    vocab, theirs = target.spec.config.vocab_size, draft.spec.config.vocab_size
    if vocab != theirs:
        raise ConfigError(f"--speculative-config: the draft model {config.model} has a vocabulary of {theirs} "
                          f"tokens, the target {vocab}: a draft must share the target's tokenizer")
    if has_recurrent_state(draft.spec.graph):
        raise ConfigError(f"--speculative-config: the draft model {config.model} has recurrent layers, which a "
                          f"draft cannot roll back yet")
    return Speculator(config, DraftModelProposer(ReferenceEngine(draft, max_tokens=draft_tokens)))


def mtp_drafter(target: LoadedModel, kv_tokens: int, engine: ReferenceEngine | None) -> FeatureDrafter:
    """The checkpoint's own multi-token-prediction head as a drafter over the model's final hidden states."""
    graph_of = getattr(target.spec.dag, "mtp_graph", None)
    if graph_of is None or target.mtp is None:
        why = "its DAG file runs none" if graph_of is None else "its checkpoint has none (no mtp.* tensors, or " \
                                                             "mtp_num_hidden_layers 0)"
        raise ConfigError(f"--speculative-config: method mtp needs the model's MTP head; {target.spec.architecture} "
                          f"at {target.folder}: {why}")
    head = graph_of(target.spec.config)
    weights = {name: target.weights[name] for name in head.checkpoint_params() if name in target.spec.graph.params}
    weights = derive_weights(head.derivations(), {**target.mtp, **weights})
    if engine is not None:
        engine.graph = with_final_hidden(engine.graph)
    return FeatureDrafter(head, head, weights, kv_tokens)
