"""LoRA adapters under tensor parallelism on the CPU engine: each rank's tables hold its part (a column-parallel
projection's rows of B, a row-parallel one's columns of A, its partial update summed by the all-reduce after it).
A batch mixing rows of two adapters and of the base gives at 2 and 4 ranks (threads, ir/ranks.py) the logits of one
rank (float32, relative error under 1e-5) at a prefill and a decode step; the sharded engine's worker processes
generate one rank's greedy tokens with adapters swapping through fewer slots; GPU ranks get LoRA graphs of their
part and their rows of an adapter."""

from pathlib import Path

import numpy as np
import pytest

from drain import drain
from pegainfer.frontends.checkpoint import derive_weights
from pegainfer.frontends.load import LoadedModel, load_model
from pegainfer.frontends.lora import LoraConfig, lora_modules, rank_rows, read_adapter, with_lora
from pegainfer.ir.graph import Graph
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.ranks import run_ranks
from pegainfer.passes.shard import Parallelism
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.kv_blocks import BlockAllocator
from pegainfer.runtime.lora import LoraSlots
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.rank_workers import RankSpec
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig
from pegainfer.runtime.sharded_engine import start_sharded_engine
from test_lora import TARGETS, make_adapter

BLOCKS, BLOCK_SIZE = 32, 4
TOLERANCE = 1e-5
CONFIG = LoraConfig(max_loras=2, max_rank=8)
# (name, rank, seed, targets): every projection, and a lower rank over attention's q/v and the MLP's exit
ADAPTERS = (("a", 8, 1, TARGETS), ("b", 4, 2, ["q_proj", "v_proj", "down_proj"]))


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_checkpoint, folder / name, rank, seed, targets)
            for name, rank, seed, targets in ADAPTERS}


def workload(vocab: int) -> list[dict[str, np.ndarray]]:
    """Two steps' inputs: prompts of 6, 3 and 9 tokens of adapters a (slot 0), b (slot 1) and the base, then a
    decode token of each; every token's logits."""
    rng = np.random.default_rng(0)
    allocator = BlockAllocator(BLOCKS, BLOCK_SIZE)
    seqs = [Sequence(i, rng.integers(0, vocab, n).tolist(), lora_slot=slot)
            for i, (n, slot) in enumerate(((6, 0), (3, 1), (9, -1)))]
    steps = []
    for plan in ([6, 3, 9], [1, 1, 1]):
        chunks = [Chunk(seq, n) for seq, n in zip(seqs, plan)]
        steps.append(pack_step(chunks, allocator, all_logits=True, lora=True))
        commit_step(chunks)
        for seq in seqs:
            seq.token_ids.append(int(rng.integers(0, vocab)))
    return steps


def fresh_states(graph: Graph) -> dict[str, np.ndarray]:
    sizes = {"num_blocks": BLOCKS, "block_size": BLOCK_SIZE}
    return {name: np.zeros(t.concrete(sizes), t.dtype.np_dtype) for name, t in graph.expanded_states().items()}


def read(folders: dict, graph: Graph) -> dict[str, dict[str, np.ndarray]]:
    """Each adapter's rows, read against `graph` (a server reads them against rank 0's)."""
    return {name: read_adapter(name, folder, graph, CONFIG).rows for name, folder in folders.items()}


def rank_run(model: LoadedModel, rows: dict[str, dict[str, np.ndarray]]) -> tuple:
    """A rank's LoRA graph, weights and states with the adapters in slots 0, 1, ... (their rows cut to its part)."""
    graph = with_lora(model.spec.graph, CONFIG)
    states = fresh_states(graph)
    for slot, adapter in enumerate(rows.values()):
        for table, row in rank_rows(adapter, graph).items():
            states[table][slot] = row
    return graph, derive_weights(graph.derivations(), model.weights), states


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_with_two_adapters_and_the_base_give_one_ranks_logits(tiny_checkpoint, adapters, world):
    """Prefill and decode of rows of a, b and the base at `world` ranks (4: each KV head held by two ranks)."""
    whole = load_model(tiny_checkpoint)
    rows = read(adapters, with_lora(whole.spec.graph, CONFIG))
    graph, weights, states = rank_run(whole, rows)
    steps = workload(graph.value_types()[graph.outputs[0]].shape[-1])
    expected = [run_graph(graph, inputs, weights, states)[0] for inputs in steps]
    plain = run_graph(graph, steps[0], weights, fresh_states(graph))[0]  # empty tables: the base model's rows
    assert np.array_equal(plain[-9:], expected[0][-9:])  # the base row takes no update
    assert not np.allclose(plain[:6], expected[0][:6], atol=1e-2) and \
        not np.allclose(plain[6:9], expected[0][6:9], atol=1e-2)  # each adapter changes its rows

    models = [load_model(tiny_checkpoint, parallel=Parallelism(world, rank)) for rank in range(world)]
    rank_graph = with_lora(models[1].spec.graph, CONFIG)
    read_there = read(adapters, rank_graph)  # a rank's graph reads the checkpoint's shapes: the same rows
    assert all(np.array_equal(read_there[name][table], rows[name][table]) for name in rows for table in rows[name])
    assert all(group.sharded for group in lora_modules(rank_graph).values())  # no rank holds a whole table
    graphs, rank_weights, rank_states = zip(*[rank_run(model, rows) for model in models])
    for step, (inputs, reference) in enumerate(zip(steps, expected)):
        for rank, logits in enumerate(run_ranks(graphs, inputs, rank_weights, rank_states)):
            error = relative_error(logits[0], reference)
            assert error < TOLERANCE, f"{world} ranks, rank {rank}, step {step}: relative error {error:.2e}"


WORK = [([5, 17, 99, 3, 250, 11, 7, 42], "a"), ([9, 8, 7], None), (list(range(30, 50)), "b"), ([4, 4, 1, 300], "c"),
        ([1, 2, 3, 4, 5], "a")]


def generate(engine, folders: dict, config: LoraConfig) -> dict[str, list]:
    """Greedy tokens and logprobs of WORK, its adapters read against the engine's graph as the server does."""
    slots = LoraSlots(engine.graph, config, engine.write_lora)
    for name, folder in folders.items():
        slots.register(read_adapter(name, folder, engine.graph, config))
    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                               max_model_len=128), lora=slots)
    for i, (prompt, lora) in enumerate(WORK):
        scheduler.add(EngineRequest(str(i), prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3),
                                    lora=lora))
    made = drain(scheduler)
    assert slots.loads > len(folders)  # three adapters through two slots: some written over another
    for name in folders:  # empty rows written over each slot (on every rank), then the base runs on
        slots.unregister(name)
    assert not any(engine.states[table].any() for table in engine.states if ".lora_" in table)
    scheduler.add(EngineRequest("base", WORK[0][0], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3)))
    made |= drain(scheduler)
    return {key: [(t.token_id, t.logprobs) for t in tokens] for key, tokens in made.items()}


def test_worker_processes_generate_one_ranks_greedy_tokens_with_adapters_swapping(tiny_checkpoint, adapters,
                                                                                  tmp_path):
    folders = dict(adapters) | {"c": make_adapter(tiny_checkpoint, tmp_path / "c", 8, 3, ["o_proj", "up_proj"])}
    model = load_model(tiny_checkpoint)
    expected = generate(ReferenceEngine(model, max_tokens=512, graph=with_lora(model.spec.graph, CONFIG), max_seqs=4),
                        folders, CONFIG)
    engine = start_sharded_engine(RankSpec(str(tiny_checkpoint), 2, kv_tokens=512, max_seqs=4, lora=CONFIG))
    try:
        found = generate(engine, folders, CONFIG)
    finally:
        engine.shutdown()
    assert found.keys() == expected.keys() == {*(str(i) for i in range(len(WORK))), "base"}
    for key, tokens in expected.items():
        assert [t for t, _ in found[key]] == [t for t, _ in tokens], f"request {key}"
        for (_, mine), (_, theirs) in zip(found[key], tokens):
            assert mine.keys() == theirs.keys()
            np.testing.assert_allclose(list(mine.values()), list(theirs.values()), atol=1e-4)


def test_gpu_ranks_run_lora_graphs_of_their_part_and_write_their_rows_of_an_adapter(tiny_checkpoint, adapters,
                                                                                     monkeypatch):
    """A worker's GPU engine gets its rank's LoRA graph (its own manifest, by model_id); rank 0's write_lora sends
    the workers the whole tables' rows and writes its own part, shaped as its graph's tables."""
    from types import SimpleNamespace

    from pegainfer.backends.cache import model_id
    from pegainfer.runtime.gpu import nccl, start
    from pegainfer.runtime.gpu.engine import EngineOptions, GpuEngine
    from pegainfer.runtime.gpu.sharded import ShardedGpuEngine
    from pegainfer.runtime.rank_workers import load_rank_engine
    from pegainfer.runtime.sharded_engine import load_rank_model, rank_model

    spec = RankSpec(str(tiny_checkpoint), 2, device="cuda", lora=CONFIG, gpu=EngineOptions(), nccl_id=b"id")
    monkeypatch.setattr(nccl, "Rendezvous", lambda *args: None)
    monkeypatch.setattr(start, "gpu_engine", lambda model, *args, **kwargs: model)
    worker = load_rank_engine(spec, 1)
    plain = load_rank_model(spec, 1, lazy=True)
    assert worker.spec.graph.expanded_states().keys() > plain.spec.graph.expanded_states().keys()
    assert model_id(worker.spec).endswith("-lora2x8") and model_id(worker.spec) != model_id(plain.spec)
    driver = ShardedGpuEngine.__new__(ShardedGpuEngine)
    sent, written = [], []
    driver.spec, driver.model = spec, rank_model(spec, load_rank_model(spec, 0, lazy=True))
    driver.ranks = SimpleNamespace(error=None, links=SimpleNamespace(send_all=lambda *message: sent.append(message)))
    monkeypatch.setattr(GpuEngine, "write_lora", lambda self, slot, rows: written.append((slot, rows)))
    rows = read(adapters, with_lora(load_model(tiny_checkpoint).spec.graph, CONFIG))["a"]
    driver.write_lora(1, rows)
    assert sent == [("write_lora", (1, rows))]
    ((slot, part),) = written
    tables = driver.graph.expanded_states()
    assert slot == 1 and part.keys() == rows.keys() and all(part[t].shape == tables[t].shape[1:] for t in part)
    assert any(part[t].shape != rows[t].shape for t in part)  # each rank holds a part of the tables
