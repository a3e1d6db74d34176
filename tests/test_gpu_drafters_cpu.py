"""What the GPU path of hidden-state drafters (EAGLE-3 and MTP heads) does that needs no GPU: the target's graph
giving features and the head's graphs, lowered and run as generated Triton kernels under the interpreter, match the
reference interpreter; each gets a manifest of its own (and `pegainfer compile --speculative-config` writes them);
the head's second graph borrows the first's and the target's weights and takes the first's KV cache; a head's row
inputs are padded for decode graphs; GpuHead splits a long catch-up into steps within its limits."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from pegainfer.backends.cache import model_id
from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.triton.execute import InterpretedExecutor, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.cli import main
from pegainfer.fixtures.draft_heads import make_eagle3_head
from pegainfer.frontends.checkpoint import derive_weights
from pegainfer.frontends.features import FEATURES
from pegainfer.frontends.load import embedded_configs, load_model, load_spec
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.step import EMBED_GATE, FEATURES_INPUT, sampler_outputs
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.drafter_graphs import drafter_graphs
from pegainfer.runtime.gpu.upload import borrowed_params
from pegainfer.runtime.gpu.head import GpuHead
from pegainfer.runtime.gpu.step_padding import pad_decode_step
from pegainfer.runtime.gpu.upload import shared_params
from pegainfer.runtime.kv_blocks import BlockAllocator
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.speculative import parse_speculative_config

PROMPTS = [[5, 17, 99, 3, 250, 11, 7], [42, 9, 1, 77]]


@pytest.fixture(scope="module")
def eagle3(checkpoint_factory, tmp_path_factory):
    """(the target's spec, its weights, the head's specs [first, next] and weights), float32."""
    folder = checkpoint_factory("tiny_tied")
    head = make_eagle3_head(folder, tmp_path_factory.mktemp("head"), layers=[0, 1, 1], draft_vocab=200)
    model = load_model(folder)
    target, heads = drafter_graphs(parse_speculative_config({"method": "eagle3", "num_speculative_tokens": 2,
                                                              "model": str(head)}), model.spec)
    from pegainfer.frontends.drafter_load import load_draft_head

    return target, model.weights, heads, load_draft_head(head, model).weights, head


def interpreted(graph, weights: dict, steps: list[dict]) -> tuple[list, list]:
    """Each step's outputs by the reference interpreter and by the graph's Triton kernels, lowered and planned as
    for the GPU, under the Triton interpreter (float32: the kernels' sums reorder, nothing rounds)."""
    lowered, _ = lower(graph)
    specs = {(g.name, n.name): plan_kernel(g, n, PlanOptions(block_size=4))
             for g in lowered.all_graphs() for n in g.nodes if n.op == KERNEL}
    derived, declared = derive_weights(lowered.derivations(), weights), derive_weights(graph.derivations(), weights)
    sizes = {"num_blocks": 16, "block_size": 4}
    expected, ours = [], []
    for run, into in ((lambda i, s: run_graph(graph, i, declared, s), expected),
                      (lambda i, s: InterpretedExecutor(lowered, specs).run(i, derived, s), ours)):
        states = {n: np.zeros(t.concrete(sizes), t.dtype.np_dtype) for n, t in graph.expanded_states().items()}
        torch_states = {n: to_torch(s) for n, s in states.items()}
        for step in steps:
            into.append(run(step, states if into is expected else torch_states))
    return expected, ours


def drawn(graph, outputs: list) -> np.ndarray:
    """The tokens the lowered graph's sampler tail drew, found as the GPU engine finds them (a graph with a
    drafter's second output has the tail's outputs after it)."""
    lowered = lower(graph)[0]
    return np.asarray(outputs[lowered.outputs.index(sampler_outputs(lowered)["sampled_ids"])])


def relative(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def prefill_then_decode(chunks_of) -> list[dict]:
    allocator = BlockAllocator(16, 4)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(PROMPTS)]
    steps = []
    for plan in ([len(p) for p in PROMPTS], None):
        if plan is None:
            for seq in seqs:
                seq.token_ids.append(3)
            plan = [1, 1]
        chunks = [Chunk(s, n) for s, n in zip(seqs, plan)]
        steps.append(chunks_of(chunks, pack_step(chunks, allocator)))
        commit_step(chunks)
    return steps


@pytest.mark.slow
def test_the_target_features_from_generated_kernels_match_the_reference(eagle3):
    target, weights, _, _, _ = eagle3
    assert FEATURES in target.graph.outputs
    expected, ours = interpreted(target.graph, weights, prefill_then_decode(lambda chunks, step: step))
    at = target.graph.outputs.index(FEATURES)
    for want, got in zip(expected, ours):
        assert got[at].shape == want[at].shape and relative(got[at], want[at]) < 1e-5
        assert relative(got[0], want[0]) < 1e-5
        assert drawn(target.graph, got).tolist() == np.argmax(want[0], -1).tolist()  # greedy: the tail's tokens


@pytest.mark.slow
def test_the_eagle3_heads_graphs_from_generated_kernels_match_the_reference(eagle3):
    _, _, heads, head_weights, _ = eagle3
    rng = np.random.default_rng(1)
    width = {spec.graph.name: spec.graph.inputs[FEATURES_INPUT].shape[1] for spec in heads}
    for spec in heads:
        def with_features(chunks, step, graph=spec.graph):
            rows = sum(c.num_tokens for c in chunks)
            return step | {FEATURES_INPUT: rng.standard_normal((rows, width[graph.name])).astype(np.float32)}
        expected, ours = interpreted(spec.graph, head_weights, prefill_then_decode(with_features))
        for want, got in zip(expected, ours):
            assert relative(got[0], want[0]) < 1e-5 and relative(got[1], want[1]) < 1e-5
            assert drawn(spec.graph, got).tolist() == np.argmax(want[0], -1).tolist()


@pytest.mark.slow
def test_an_mtp_heads_graph_from_generated_kernels_matches_the_reference():
    """Qwen3.5's MTP head (tied embeddings: its LM head is the embedding), float32, its embedding gated at
    position 0 as the drafter gates it."""
    from pegainfer.frontends.config import normalize_hf_config, parse_config
    from pegainfer.models import qwen3_5
    from random_models import random_weights

    raw = normalize_hf_config({**qwen3_5.TINY_CONFIG, "mtp_num_hidden_layers": 1, "torch_dtype": "float32"})
    graph = qwen3_5.mtp_graph(parse_config(qwen3_5.Config, raw, "tiny"))
    rng = np.random.default_rng(2)
    weights = random_weights(graph, rng)
    hidden = graph.inputs[FEATURES_INPUT].shape[1]

    def with_features(chunks, step):
        rows = sum(c.num_tokens for c in chunks)
        return step | {FEATURES_INPUT: rng.standard_normal((rows, hidden)).astype(np.float32),
                       EMBED_GATE: (step["positions"] != 0).astype(np.float32)[:, None]}
    expected, ours = interpreted(graph, weights, prefill_then_decode(with_features))
    for want, got in zip(expected, ours):
        assert relative(got[0], want[0]) < 1e-5 and relative(got[1], want[1]) < 1e-5


def test_each_drafter_graph_has_a_manifest_of_its_own(eagle3, checkpoint_factory):
    target, _, heads, _, _ = eagle3
    plain = load_spec(checkpoint_factory("tiny_tied") / "config.json")
    ids = [model_id(s) for s in (plain, target, *heads)]
    assert len(set(ids)) == 4 and all(i.endswith("-features") for i in ids[1:]) and not ids[0].endswith("features")
    spec = load_spec(embedded_configs()["qwen3.5-4b"])
    mtp_target, (mtp_head,) = drafter_graphs(parse_speculative_config({"method": "mtp", "num_speculative_tokens": 1}),
                                             spec)
    assert len({model_id(s) for s in (spec, mtp_target, mtp_head)}) == 3


def test_compile_with_a_speculative_config_writes_the_target_and_head_manifests(eagle3, checkpoint_factory, tmp_path,
                                                                                 capsys):
    head_folder = eagle3[4]
    config = json.dumps({"method": "eagle3", "num_speculative_tokens": 2, "model": str(head_folder)})
    folder = checkpoint_factory("tiny_tied")
    assert main(["compile", str(folder), "--sm", "90", "--backends", "triton", "--cache-dir", str(tmp_path),
                 "--speculative-config", config, "--jobs", "2"]) == 0
    written = sorted(p.name for p in (tmp_path / "sm_90" / "manifests").iterdir())
    target, heads = drafter_graphs(parse_speculative_config(config), load_spec(folder / "config.json", device="cuda"))
    assert written == sorted(f"{model_id(s)}.json" for s in (target, *heads))
    assert main(["compile", str(folder), "--sm", "90", "-tp", "2", "--cache-dir", str(tmp_path),
                 "--speculative-config", config]) == 1
    assert "runs on one GPU" in capsys.readouterr().err


def test_the_heads_graphs_borrow_the_targets_weights_and_the_second_takes_the_firsts_kv_cache(eagle3, tmp_path,
                                                                                              monkeypatch):
    from test_gpu_runtime_cpu import stand_in_executor

    target, _, (first, second), _, _ = eagle3
    made = {}
    lends = {"target": frozenset({"model.embed_tokens.weight"}), "first": None}  # as GpuHead lends
    for name, spec, lenders in (("target", target, []), ("first", first, ["target"]), ("next", second, ["first"])):
        (tmp_path / name).mkdir()
        lent = borrowed_params(lower(spec.graph)[0], [(made[n], lends[n]) for n in lenders])
        made[name] = stand_in_executor(tmp_path / name, monkeypatch, None, spec=spec, borrowed=lent,
                                       kv_of=made["first"] if name == "next" else None)[0]
        made[name].lent = set(lent)
    assert made["first"].lent == {"model.embed_tokens.weight"}  # the head's LM head is over its own vocabulary
    assert made["next"].lent == set(made["next"].graph.expanded_params())  # all of it is the first graph's
    assert made["next"].weights == {n: made["first"].weights[n] for n in made["next"].lent}
    assert made["first"].weights["model.embed_tokens.weight"] == made["target"].weights["model.embed_tokens.weight"]
    kv = {n: t.ptr for n, t in made["first"].states.items()}
    assert kv and {n: t.ptr for n, t in made["next"].states.items()} == kv


def test_a_head_borrows_only_what_is_the_targets_even_where_its_own_lm_head_matches(checkpoint_factory, tmp_path):
    """A full-vocabulary head over an untied target: its lm_head.weight has the target's name, shape and dtype but is
    its own; only the embedding is lent."""
    from pegainfer.frontends.drafter_load import load_draft_head

    folder = checkpoint_factory("tiny_untied", {"tie_word_embeddings": False})
    model = load_model(folder)
    head = load_draft_head(make_eagle3_head(folder, tmp_path / "head", layers=[0, 1, 1]), model)
    lowered = {name: lower(graph)[0] for name, graph in (("target", model.spec.graph), ("head", head.first))}
    target = SimpleNamespace(executor=SimpleNamespace(graph=lowered["target"], weights=dict.fromkeys(
        lowered["target"].expanded_params(), 0x1000)))
    assert "lm_head.weight" in shared_params(lowered["head"], lowered["target"])
    assert set(borrowed_params(lowered["head"], [(target.executor, head.from_target)])) == {"model.embed_tokens.weight"}
    assert head.weights["lm_head.weight"].shape[0] == model.spec.config.vocab_size  # its own, read from its file
    assert not np.array_equal(head.weights["lm_head.weight"], model.weights["lm_head.weight"])


def test_a_head_steps_row_inputs_are_padded_with_zeros_for_its_decode_graph():
    allocator = BlockAllocator(8, 4, reserved=1)
    chunks = [Chunk(Sequence(i, [3, 4]), 2) for i in range(3)]
    step = pack_step(chunks, allocator) | {FEATURES_INPUT: np.ones((6, 5), np.float32),
                                           EMBED_GATE: np.ones((6, 1), np.float32)}
    commit_step(chunks)
    decode = [Chunk(c.seq, 1) for c in chunks]
    for c in decode:
        c.seq.token_ids.append(1)
    step = pack_step(decode, allocator) | {FEATURES_INPUT: np.full((3, 5), 2, np.float32),
                                           EMBED_GATE: np.ones((3, 1), np.float32)}
    padded = pad_decode_step(step, 8)
    assert padded[FEATURES_INPUT].shape == (8, 5) and padded[EMBED_GATE].shape == (8, 1)
    assert (padded[FEATURES_INPUT][:3] == 2).all() and not padded[FEATURES_INPUT][3:].any()
    assert not padded[EMBED_GATE][3:].any()


def test_a_long_catch_up_runs_in_steps_within_the_limits_and_drafts_after_its_last_part():
    """Chunks of 7 and 4 tokens, steps of at most 5 tokens: [5], [2 + 3], [1]; each chunk's draft is its last
    part's, and its output row that part's last one."""
    calls = []

    class Engine:
        graph = SimpleNamespace(inputs={FEATURES_INPUT: None})

        def sample(self, chunks, params, index, inputs=None):
            step = {"positions": np.concatenate([np.arange(c.seq.num_cached, c.seq.num_cached + c.num_tokens)
                                                 for c in chunks])}
            rows = inputs(step)[FEATURES_INPUT]
            calls.append(([c.num_tokens for c in chunks], rows[:, 0].tolist()))
            for c in chunks:
                c.seq.num_cached += c.num_tokens
            assert all(p == SamplingParams(temperature=0.0) for p in params)
            return SimpleNamespace(tokens=[100 * len(calls) + i for i in range(len(chunks))], features=rows * 10)

    head = GpuHead.__new__(GpuHead)
    head.engines, head.max_tokens, head.max_seqs = {True: Engine()}, 5, 4
    chunks = [Chunk(Sequence(0, list(range(7))), 7), Chunk(Sequence(1, list(range(4))), 4)]
    features = np.arange(11, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    tokens, own = head.run(True, chunks, features)
    assert calls == [([5], [0, 1, 2, 3, 4]), ([2, 3], [5, 6, 7, 8, 9]), ([1], [10])]
    assert tokens.tolist() == [200, 300] and own[:, 0].tolist() == [60, 100]


def test_a_hidden_state_drafter_on_several_gpus_is_refused_at_start():
    from pegainfer.errors import ConfigError
    from pegainfer.runtime.drafter_graphs import refuse_sharded

    for method in ("eagle3", "mtp"):
        config = parse_speculative_config({"method": method, "num_speculative_tokens": 2}
                                          | ({"model": "x"} if method == "eagle3" else {}))
        with pytest.raises(ConfigError, match="runs on one GPU for now"):
            refuse_sharded(config, "cuda", True)
        refuse_sharded(config, "cpu", True)  # the CPU's ranks run it
        refuse_sharded(config, "cuda", False)
    refuse_sharded(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}), "cuda", True)
