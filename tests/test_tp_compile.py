"""A sharded model through the compiler: each rank's kernel DAG keeps its collectives as nodes between kernels
(NCCL's, never fused into one, each output given a buffer); every rank's generated Triton kernels, run under the
interpreter with the ranks as threads, give the unsharded model's logits; `pegainfer compile --tensor-parallel-size`
writes one manifest per rank, named by its layout, the ranks' identical kernels sharing their cubins; `inspect` shows
one rank's graph, passes and kernels; a bad size is one line."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from golden_configs import GOLDEN_CONFIGS
from pegainfer.backends.cache import manifest_path, model_id
from pegainfer.backends.manifest import check_lowering, load
from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.triton.execute import InterpretedExecutor, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.cli import main
from pegainfer.errors import PegainferError
from pegainfer.frontends.checkpoint import derive_weights
from pegainfer.frontends.load import embedded_configs, load_model, load_spec
from pegainfer.frontends.registry import dag_modules
from pegainfer.ir import ranks
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.kernel import inner_nodes
from pegainfer.ir.ops import collective
from pegainfer.passes.kernels import is_collective, list_collectives, list_kernels
from pegainfer.passes.memory import check_buffers
from pegainfer.passes.pipeline import lower
from pegainfer.passes.shard import Parallelism
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.kv_blocks import BlockAllocator

BLOCKS, BLOCK_SIZE = 16, 4
CASES = ["tiny_tied", "qwen3_moe_topk"]
# smaller still for the interpreter (a few seconds a launch at the golden sizes), with an odd vocabulary's padding
SMALL = {"vocab_size": 261, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": False}
INTERPRETED = {"qwen3_small": ("Qwen3ForCausalLM", SMALL),
               "qwen3_moe_small": ("Qwen3MoeForCausalLM", {**SMALL, "moe_intermediate_size": 24, "num_experts": 6,
                                                           "num_experts_per_tok": 2})}


def rank_graphs(checkpoint: Path, world: int, device: str = "cuda") -> list:
    return [lower(load_spec(checkpoint / "config.json", device=device, parallel=Parallelism(world, rank)).graph)[0]
            for rank in range(world)]


@pytest.mark.parametrize("name", CASES)
def test_collectives_stay_nodes_between_kernels_each_output_with_a_buffer(checkpoint_factory, name):
    folder = checkpoint_factory(name)
    for lowered in rank_graphs(folder, 2):
        collectives = list_collectives(lowered)
        assert {c.op for c in collectives} == {"all_reduce", "all_gather"}
        for g in lowered.all_graphs():
            check_buffers(g)
            for node in g.nodes:
                assert node.op != KERNEL or not any(is_collective(inner) for inner in inner_nodes(node)), node.name
                if is_collective(node):
                    assert g.buffers[node.outputs[0]] != g.buffers[node.inputs[0]]  # NCCL reads one, writes another
        kinds = [k.kind for k in list_kernels(lowered)]
        assert kinds[-1] == "sampler_tail" and "lm_head_tail" not in kinds  # the draw after the gathered logits
        nodes = lowered.nodes
        gather = next(i for i, n in enumerate(nodes) if n.op == "all_gather")
        assert nodes[gather - 1].attrs["name"] == "lm_head" and nodes[-1].attrs["kind"] == "sampler_tail"


def workload(vocab: int) -> list[dict[str, np.ndarray]]:
    """A prefill of prompts of 5 and 3 tokens, then a decode step of both."""
    rng = np.random.default_rng(1)
    allocator = BlockAllocator(BLOCKS, BLOCK_SIZE)
    seqs = [Sequence(i, rng.integers(0, vocab, n).tolist()) for i, n in enumerate((5, 3))]
    steps = []
    for plan in ([5, 3], [1, 1]):
        chunks = [Chunk(seq, n) for seq, n in zip(seqs, plan)]
        steps.append(pack_step(chunks, allocator))
        commit_step(chunks)
        for seq in seqs:
            seq.token_ids.append(int(rng.integers(0, vocab)))
    return steps


def fresh_states(graph) -> dict[str, np.ndarray]:
    sizes = {"num_blocks": BLOCKS, "block_size": BLOCK_SIZE}
    return {n: np.zeros(t.concrete(sizes), t.dtype.np_dtype) for n, t in graph.expanded_states().items()}


def interpreted_ranks(folder: Path, world: int, steps, monkeypatch) -> list[list[np.ndarray]]:
    """Each step's logits from every rank: its graph's planned Triton launches under the interpreter, the ranks as
    threads meeting in each collective's reference."""
    group, local = ranks.RankGroup(world), threading.local()
    monkeypatch.setattr(collective, "current_rank", lambda op, w: (group, local.rank))
    models = [load_model(folder, parallel=Parallelism(world, rank)) for rank in range(world)]
    results: list = [None] * world

    def run(rank: int) -> None:
        local.rank = rank
        graph = lower(models[rank].spec.graph)[0]
        specs = {(g.name, n.name): plan_kernel(g, n, PlanOptions(block_size=BLOCK_SIZE))
                 for g in graph.all_graphs() for n in g.nodes if n.op == KERNEL}
        weights = derive_weights(graph.derivations(), models[rank].weights)
        states = {n: to_torch(s) for n, s in fresh_states(graph).items()}
        executor = InterpretedExecutor(graph, specs)
        try:
            results[rank] = [executor.run(inputs, weights, states) for inputs in steps]
        except BaseException as error:  # noqa: BLE001  the other rank would wait at the next collective
            group.abort()
            results[rank] = error
    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", INTERPRETED)
def test_every_ranks_triton_kernels_give_the_unsharded_logits_under_the_interpreter(checkpoint_factory, monkeypatch,
                                                                                    name):
    """Float32 weights: the embedding's part of the vocabulary (ids of other ranks read as zeros), the row-parallel
    GEMMs' partial sums, the LM head's part (padded: 261 ids over 2 ranks), the gathered logits cut to the vocabulary
    and the sampler tail over them, as launched."""
    architecture, overrides = INTERPRETED[name]
    folder = checkpoint_factory(name, overrides, architecture=architecture)
    whole = load_model(folder)
    graph = whole.spec.graph
    steps = workload(graph.value_types()[graph.outputs[0]].shape[-1])
    states = fresh_states(graph)
    weights = derive_weights(graph.derivations(), whole.weights)
    expected = [run_graph(graph, inputs, weights, states)[0] for inputs in steps]
    per_rank = interpreted_ranks(folder, 2, steps, monkeypatch)
    for rank, outputs in enumerate(per_rank):
        for step, (ours, reference) in enumerate(zip(outputs, expected)):
            error = np.abs(ours[0] - reference).max() / np.abs(reference).max()
            assert error < 1e-4, f"{name}: rank {rank}, step {step}: relative error {error:.2e}"
            assert (ours[4] == reference.argmax(-1)).all()  # the sampler tail's greedy draw over the gathered rows


def test_a_manifest_is_named_by_the_parallel_layout_it_was_compiled_for(tmp_path):
    """TP 1, each rank of TP 2 and of TP 4: all different names, each saying its layout."""
    config = embedded_configs()["qwen3-0.6b"]
    layouts = [Parallelism()] + [Parallelism(world, rank) for world in (2, 4) for rank in range(world)]
    names = [model_id(load_spec(config, device="cuda", parallel=p)) for p in layouts]
    assert len(set(names)) == len(names)
    assert "-tp" not in names[0] and names[2].endswith("-tp2-rank1") and names[6].endswith("-tp4-rank3")
    assert len({manifest_path(tmp_path, 90, load_spec(config, device="cuda", parallel=p)) for p in layouts}) == 7


def tiny_config(tmp_path: Path, architecture: str) -> Path:
    config = tmp_path / architecture / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(dag_modules()[architecture].TINY_CONFIG))
    return config


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_compile_writes_a_manifest_per_rank_whose_shared_kernels_share_cubins(tmp_path, capsys, architecture):
    """Every installed backend (as test_compile_archs): two manifests, one a rank, named apart; the ranks' kernels
    differ only in the embedding (its first id), every other launch one cubin for both; the collectives are no
    kernels; a rank's manifest is refused for the other rank's graph."""
    config, cache = tiny_config(tmp_path, architecture), tmp_path / "cache"
    assert main(["compile", str(config), "--sm", "90", "-tp", "2", "--jobs", "2", "--cache-dir", str(cache)]) == 0
    err = capsys.readouterr().err
    assert "2 rank manifests (2 ranks)" in err
    paths = [Path(line.split("manifest ")[-1]) for line in err.splitlines() if line.startswith("pegainfer: manifest")]
    assert [p.name.removesuffix(".json")[-10:] for p in paths] == ["-tp2-rank0", "-tp2-rank1"]
    manifests = [load(path) for path in paths]
    keys = [{(k.node, launch.key) for k in m.kernels for v in k.candidates for launch in v.launches} for m in manifests]
    assert {node for node, _ in keys[0] ^ keys[1]} == {"embed.partial"}
    for manifest in manifests:
        assert not {"all_reduce", "all_gather"} & {op for k in manifest.kernels for op in k.ops}
        assert {"sampler_tail", "embedding"} <= {k.kind for k in manifest.kernels}
        for kernel in manifest.kernels:
            for launch in (launch for v in kernel.variants for launch in v.launches):
                assert (paths[0].parent.parent / launch.cubin).read_bytes()[:4] == b"\x7fELF"
    other = lower(load_spec(config, device="cuda", parallel=Parallelism(2, 1)).graph)[0]
    with pytest.raises(PegainferError, match="compiled from another lowering"):
        check_lowering(manifests[0], paths[0], other)


def one_line(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main([str(a) for a in args])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0] == err.strip().splitlines()[-1], err
    return code, errors[0]


@pytest.mark.parametrize("args, code, words", [
    (["compile", "qwen3-0.6b", "--sm", "90", "-tp", "0"], 2, "expected a positive integer, got '0'"),
    (["compile", "qwen3-0.6b", "--sm", "90", "-tp", "3"], 1, "q_proj.weight has 16 heads or rows"),
    (["compile", "qwen3-0.6b", "--sm", "90", "--enable-expert-parallel"], 2, "applies with --tensor-parallel-size"),
    (["inspect", "qwen3-0.6b", "-tp", "2", "--rank", "2"], 2, "--rank 2: expected a rank below"),
    (["inspect", "qwen3-0.6b", "--rank", "1"], 2, "--rank applies with --tensor-parallel-size above 1"),
], ids=["zero", "heads", "expert_parallel_alone", "rank_past_world", "rank_alone"])
def test_a_bad_parallel_layout_is_one_line(capsys, tmp_path, args, code, words):
    got, line = one_line(capsys, *args, *(["--cache-dir", tmp_path / "cache"] if args[0] == "compile" else []))
    assert got == code and words in line, line


def test_inspect_shows_one_ranks_graph_its_passes_and_its_kernels(capsys):
    assert main(["inspect", "qwen3-0.6b", "-tp", "2", "--rank", "1", "--show", "graph"]) == 0
    assert "all_reduce(" in capsys.readouterr().out
    assert main(["inspect", "qwen3-0.6b", "-tp", "2", "--rank", "1", "--show", "passes"]) == 0
    out = capsys.readouterr().out
    assert "# after pass 3: shard_tensor_parallel (sharding)" in out and "# note: rank 1 of 2" in out
    assert main(["inspect", "qwen3-0.6b", "-tp", "2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "Collectives between the kernels (NCCL's, not kernels): 58 per step" in out
    assert "sampler_tail" in out and "bf16[samples,75968]" in out  # the rank's half of the vocabulary
