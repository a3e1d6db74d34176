"""Proposers of draft tokens for speculative decoding (runtime/speculative.py): n-gram prompt lookup, which needs
no weights, and a draft model, a smaller model of the same vocabulary that drafts greedily on an engine of its own
with its own KV cache, kept in step with each target sequence's accepted tokens."""

from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path

from pegainfer.errors import ConfigError
from pegainfer.frontends.drafter_load import DraftHead, LentWeights, load_draft_head
from pegainfer.frontends.checkpoint import derive
from pegainfer.frontends.features import FEATURES
from pegainfer.frontends.hub import resolve_checkpoint
from pegainfer.frontends.load import LoadedModel, load_model
from pegainfer.ir.step import has_recurrent_state
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.drafter_graphs import FEATURE_METHODS, drafter_graphs, refuse_sharded
from pegainfer.runtime.drafters import FeatureDrafter, InterpretedHead
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.speculative import DraftRequest, SpeculativeConfig, Speculator, ngram_drafts


GREEDY = SamplingParams(temperature=0.0)
DRAFT_WORKSPACE = 1 << 30  # a draft engine's activations, step inputs and graphs: bytes kept beside its weights


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.shortest, self.longest = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        return [ngram_drafts(r.tokens, r.k, self.shortest, self.longest) for r in requests]

    def release(self, seq_id: int) -> None:
        pass


class DraftModelProposer:
    """`engine` (a ReferenceEngine, or a GpuEngine beside the target's) steps the draft sequences: first each one's
    tokens not yet in its cache (the whole prompt the first time, then the target's newly accepted tokens), then
    one token a step, each drawn greedily on the engine; steps of at most `max_tokens` tokens and `max_seqs`
    sequences. A sequence whose tokens the draft's KV pool cannot hold gets no drafts (its draft cache is given up):
    a draft pool smaller than the target's costs speculation, never a request."""

    def __init__(self, engine, max_tokens: int | None = None, max_seqs: int | None = None) -> None:
        self.engine, self.max_tokens, self.max_seqs = engine, max_tokens, max_seqs
        self.seqs: dict[int, Sequence] = {}

    def propose(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active = self._fitting(requests)
        seqs = {i: self._follow(requests[i]) for i in active}
        while active:
            chunks = [Chunk(seqs[i], len(seqs[i].token_ids) - seqs[i].num_cached) for i in active]
            for i, token in zip(active, self._draw(chunks)):
                drafts[i].append(token)
                seqs[i].token_ids.append(token)
            active = [i for i in active if len(drafts[i]) < requests[i].k]
        return drafts

    def release(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self.engine.release(seq)

    def _fitting(self, requests: Seq[DraftRequest]) -> list[int]:
        """The requests to draft for: those wanting drafts whose tokens and drafts the free blocks hold, in order;
        the others' draft caches are given up, their blocks going to the ones after."""
        allocator, active = self.engine.allocator, []
        free = allocator.num_free
        for i, request in enumerate(requests):
            if request.k <= 0:
                continue
            seq = self.seqs.get(request.seq_id)
            held = len(seq.table.blocks) if seq is not None else 0
            need = max(allocator.blocks_for(len(request.tokens) + request.k) - held, 0)  # it keeps what it holds
            if need <= free:
                free -= need
                active.append(i)
            elif seq is not None:
                self.release(request.seq_id)
                free += held
        return active

    def _draw(self, chunks: list[Chunk]) -> list[int]:
        """Each chunk run and its next token drawn greedily, in steps within the engine's limits (a chunk longer than
        a step runs in parts, its token drawn after the last)."""
        tokens: dict[int, int] = {}
        pending = list(chunks)
        while pending:
            step, used = [], 0
            for chunk in pending:
                if len(step) == (self.max_seqs or len(pending)) or (self.max_tokens and used == self.max_tokens):
                    break
                take = chunk.num_tokens if not self.max_tokens else min(chunk.num_tokens, self.max_tokens - used)
                step.append(Chunk(chunk.seq, take))
                used += take
            drawn = self.engine.sample(step, [GREEDY] * len(step), [0] * len(step)).tokens
            rest = [Chunk(c.seq, c.num_tokens - part.num_tokens) for c, part in zip(pending, step)
                    if part.num_tokens < c.num_tokens]
            tokens.update((part.seq.seq_id, token) for c, part, token in zip(pending, step, drawn)
                          if part.num_tokens == c.num_tokens)
            pending = rest + pending[len(step):]
        return [tokens[c.seq.seq_id] for c in chunks]

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
                    max_seqs: int, dtype: str = "auto", engine=None, cache_dir: Path | None = None) -> Speculator:
    """The proposer a config names, its draft model loaded beside the target (same vocabulary, else one line). A
    head that reads the target's hidden states needs `engine` (the target's) to give them: a graph gives them from
    its engine's start (drafter_graphs.drafting_target), a sharded CPU engine's is given them here.
    On cuda a draft model or head runs on GPU engines of its own beside `engine`."""
    if config.method == "ngram":
        return Speculator(config, NgramProposer(config))
    draft_tokens = kv_tokens + max_seqs * config.num_speculative_tokens
    if config.method in FEATURE_METHODS:
        if engine is not None and FEATURES not in engine.graph.outputs:  # a sharded model's
            refuse_sharded(config, device, sharded=True)
            engine.graph = drafter_graphs(config, replace(target.spec, graph=engine.graph))[0].graph
        head = eagle3_head(config, target) if config.method == "eagle3" else mtp_head(target)
        if device == "cpu":
            runner = InterpretedHead(head.first, head.next, head.weights, draft_tokens)
        else:
            from pegainfer.runtime.gpu.head import GpuHead

            runner = GpuHead(head, engine, draft_tokens, cache_dir)
        to_target = (lambda ids: ids) if head.to_target is None else head.to_target.__getitem__
        return Speculator(config, FeatureDrafter(runner, to_target=to_target))
    draft = load_model(resolve_checkpoint(config.model).folder, dtype=dtype, device=device, lazy=device != "cpu")
    vocab, theirs = target.spec.config.vocab_size, draft.spec.config.vocab_size
    if vocab != theirs:
        raise ConfigError(f"--speculative-config: the draft model {config.model} has a vocabulary of {theirs} "
                          f"tokens, the target {vocab}: a draft must share the target's tokenizer")
    if has_recurrent_state(draft.spec.graph):
        raise ConfigError(f"--speculative-config: the draft model {config.model} has recurrent layers, which a "
                          f"draft cannot roll back yet")
    if device == "cpu":
        return Speculator(config, DraftModelProposer(ReferenceEngine(draft, max_tokens=draft_tokens)))
    gpu = gpu_draft_engine(draft, engine, draft_tokens, cache_dir)
    return Speculator(config, DraftModelProposer(gpu, gpu.options.max_tokens, gpu.options.max_batch))


def gpu_draft_engine(draft: LoadedModel, target, kv_tokens: int, cache_dir: Path | None):
    """The draft model's GPU engine, of the target engine's limits: a pool of `kv_tokens` where the target's was
    given in tokens, else the memory the target left it (draft_reserve), no speculation of its own."""
    from pegainfer.runtime.gpu.start import gpu_engine

    options = replace(target.options, kv_tokens=kv_tokens if target.options.kv_tokens is not None else None,
                      max_samples=0, verify_tokens=0, spare_states=0, state_snapshots=0, kv_share=1.0,
                      reserved_bytes=0)
    return gpu_engine(draft, options, cache_dir)


def draft_reserve(config: SpeculativeConfig, target: LoadedModel, dtype: str = "auto") -> tuple[int, float]:
    """What a GPU target leaves a draft model's or head's engines beside it: bytes for the drafter's weights (a
    head's borrowed embedding counted too) and activations, and the share of the KV budget the target keeps (by KV
    bytes a token, so both pools hold as many tokens)."""
    from pegainfer.frontends.load import load_spec
    from pegainfer.runtime.bench import kv_bytes_per_token, weight_bytes

    if config.method in FEATURE_METHODS:
        spec = drafter_graphs(config, target.spec)[1][0]
    else:
        spec = load_spec(resolve_checkpoint(config.model).folder / "config.json", dtype=dtype, device="cuda")
    own, theirs = kv_bytes_per_token(target.spec), kv_bytes_per_token(spec)
    return int(weight_bytes(spec)) + DRAFT_WORKSPACE, own / (own + theirs)


def eagle3_head(config: SpeculativeConfig, target: LoadedModel) -> DraftHead:
    return load_draft_head(resolve_checkpoint(config.model).folder, target)


def mtp_head(target: LoadedModel) -> DraftHead:
    """The checkpoint's own multi-token-prediction head, a drafter over the model's final hidden states: one
    graph, over its own features and the target's alike."""
    graph_of = getattr(target.spec.dag, "mtp_graph", None)
    if graph_of is None or target.mtp is None:
        why = "its DAG file runs none" if graph_of is None else "its checkpoint has none (no mtp.* tensors, or " \
                                                             "mtp_num_hidden_layers 0)"
        raise ConfigError(f"--speculative-config: method mtp needs the model's MTP head; {target.spec.architecture} "
                          f"at {target.folder}: {why}")
    head = graph_of(target.spec.config)
    lent = frozenset(name for name in head.checkpoint_params() if name in target.spec.graph.params)
    weights = LentWeights(dict(target.mtp), target.weights, lent)
    weights.own |= {name: derive(d, weights) for name, d in head.derivations().items()}  # its regrouped q_proj
    return DraftHead(head, head, weights, None, [], replace(target.spec, graph=head), lent)
