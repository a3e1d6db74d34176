"""Speculation's verify steps in CUDA graphs, on the CPU: a step of decode tokens and their drafts padded to a
bucket of sequences of K + 1 tokens gives each real token the logits (and the KV) it gives unpadded; the GPU engine
plans a verify graph only where that padding is safe, and draws from the real rows of the padded step."""

import types

import numpy as np
import pytest

from pegainfer.frontends.load import load_model
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence, pack_step
from pegainfer.runtime.device_sampling import greedy_inputs
from pegainfer.runtime.gpu.engine import EngineOptions, GpuEngine, StepPlan, decode_buckets
from pegainfer.ir.step import STATE_SLOTS
from pegainfer.runtime.gpu.step_padding import PADDING_BLOCK, PADDING_SLOT, pad_verify_step, verify_rows
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams

PROMPTS = [[5, 9, 200, 17, 3, 8], [7, 1, 2], [4] * 19]
DRAFTS = [[11, 12, 13], [], [40, 41]]


def prefilled(model, graph=None) -> tuple[ReferenceEngine, list[Sequence]]:
    engine = ReferenceEngine(model, max_tokens=512, block_size=4, graph=graph)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(PROMPTS)]
    engine.step([Chunk(s, len(s.token_ids) - 1) for s in seqs])  # all but the last token: it decodes next
    for seq, drafts in zip(seqs, DRAFTS):
        seq.token_ids += drafts
    return engine, seqs


def verify_chunks(seqs: list[Sequence]) -> list[Chunk]:
    return [Chunk(s, 1 + len(d), draws=1 + len(d)) for s, d in zip(seqs, DRAFTS)]


def test_verify_rows_place_each_sequence_at_its_stride():
    assert verify_rows(np.array([4, 1, 3]), 5).tolist() == [0, 1, 2, 3, 5, 10, 11, 12]
    with pytest.raises(AssertionError, match="6 tokens in a verify step 5 wide"):
        verify_rows(np.array([6]), 5)


@pytest.mark.parametrize("lowered", [False, True])
def test_a_padded_verify_step_gives_the_real_rows_their_logits_and_writes_only_their_kv(tiny_checkpoint, lowered):
    model = load_model(tiny_checkpoint)
    graph = lower(model.spec.graph)[0] if lowered else None
    (plain, plain_seqs), (padded, padded_seqs) = prefilled(model, graph), prefilled(model, graph)
    step = pack_step(verify_chunks(plain_seqs), plain.allocator)
    expected = plain.execute(step)[0]
    wide, draws = pad_verify_step(pack_step(verify_chunks(padded_seqs), padded.allocator), bucket=4, width=5)
    found = padded.execute(wide)[0]
    assert len(wide["query_lens"]) == 4 and wide["input_ids"].shape == (20,) and found.shape[0] == 20
    assert draws.tolist() == [0, 1, 2, 3, 5, 10, 11, 12]
    np.testing.assert_allclose(found[draws], expected, rtol=1e-5, atol=1e-4)  # float32 GEMMs of 8 and 20 rows
    assert (wide["slot_mapping"][np.setdiff1d(np.arange(20), draws)] == -1).all(), "padding writes no KV"
    assert (wide["block_tables"][3] == PADDING_BLOCK).all()
    for name, pool in plain._kv_pools().items():
        assert ((padded._kv_pools()[name] != 0) == (pool != 0)).all(), f"{name}: a slot written by padding"
        np.testing.assert_allclose(padded._kv_pools()[name], pool, rtol=1e-5, atol=1e-5, err_msg=name)


def test_padded_rows_keep_each_draws_sampling_inputs():
    model_free = {"query_lens": np.array([2, 1]), "seq_starts": np.array([0, 2]), "input_ids": np.array([1, 2, 3]),
                  "positions": np.array([7, 8, 4]), "slot_mapping": np.array([30, 31, 12]),
                  "block_tables": np.array([[7, 8], [3, 0]], np.int32), "context_lens": np.array([9, 5]),
                  "logits_indices": np.array([0, 1, 2])}
    sampling = greedy_inputs(3)
    sampling["sampling_temperature"][:] = [0.5, 0.6, 0.7]
    wide, draws = pad_verify_step(model_free | sampling, bucket=2, width=3)
    assert draws.tolist() == [0, 1, 3]
    assert wide["sampling_temperature"].tolist() == pytest.approx([0.5, 0.6, 0, 0.7, 0, 0])
    assert wide["context_lens"].tolist() == [10, 7] and wide["positions"].tolist() == [7, 8, 0, 4, 0, 0]
    assert wide["input_ids"].tolist() == [1, 2, 0, 3, 0, 0]


def planner(verify_tokens: int = 5, recurrent: bool = False, max_tokens: int = 64) -> GpuEngine:
    """The engine's step planning without a device: its options, limits and buckets."""
    engine = GpuEngine.__new__(GpuEngine)
    engine.options = EngineOptions(max_tokens=max_tokens, max_batch=8, max_model_len=64, verify_tokens=verify_tokens)
    engine.executor = types.SimpleNamespace(limits=types.SimpleNamespace(max_tokens=max_tokens, samples=32,
                                                                         max_blocks_per_seq=4, block_size=16))
    engine.buckets, engine._slots = decode_buckets(8), (9 if recurrent else 0, 0)
    return engine


def plan_of(engine: GpuEngine, lens: list[int], draws: list[int] | None = None, cached: int = 10,
            split: bool = False) -> StepPlan:
    seqs = [Sequence(i, list(range(cached + n))) for i, n in enumerate(lens)]
    for seq in seqs:
        seq.num_cached = cached
    chunks = [Chunk(s, n, draws=d) for s, n, d in zip(seqs, lens, draws or lens)]
    step = {"context_lens": np.array([cached + n for n in lens]), "query_lens": np.array(lens)}
    return engine._plan(chunks, step, False, split)


def test_the_engine_plans_verify_graphs_only_where_padding_is_safe():
    engine = planner()
    assert plan_of(engine, [1, 1, 1]) == StepPlan(4, False, 1)  # decode
    assert plan_of(engine, [3, 1, 5]) == StepPlan(4, False, 5)  # verify, 4 x 5 rows
    assert plan_of(engine, [6, 1]) == StepPlan(None)  # more tokens than K + 1
    assert plan_of(engine, [3, 1], draws=[1, 1]) == StepPlan(2, False, 5)  # a short chunk drawn at its last token
    assert plan_of(engine, [3, 1], draws=[2, 1]) == StepPlan(None)
    assert plan_of(engine, [3, 1], split=True) == StepPlan(None, True)  # a grammar's masks are filled late
    assert plan_of(engine, [2] * 5) == StepPlan(None)  # bucket 8 x 5 rows past the 32 samples
    assert plan_of(engine, [2, 2], cached=60) == StepPlan(None)  # its padding would pass the 64-token table
    assert plan_of(planner(recurrent=True), [3, 1]) == StepPlan(None)  # padding would advance the state
    assert plan_of(planner(recurrent=True), [5, 5, 5]) == StepPlan(4, False, 5)  # whole padding sequences only
    assert plan_of(planner(recurrent=True), [2, 2], draws=[1, 1]) == StepPlan(2, False, 2)  # kept tokens run again
    assert plan_of(planner(recurrent=True), [2, 3], draws=[1, 3]) == StepPlan(None)
    assert plan_of(planner(recurrent=True), [3, 3], draws=[2, 3]) == StepPlan(None)
    assert plan_of(planner(verify_tokens=0), [3, 1]) == StepPlan(None)
    seqs = [Sequence(0, list(range(13))), Sequence(1, list(range(11)))]
    for seq in seqs:
        seq.num_cached = 10
    step = {"context_lens": np.array([13, 11]), "query_lens": np.array([3, 1])}
    chunks = [Chunk(seqs[0], 3, draws=3), Chunk(seqs[1], 1)]
    assert engine._plan(chunks, step, False, False, verify=False) == StepPlan(None)  # run/step read rows unmapped


@pytest.mark.parametrize("with_tokens", [True, False])
def test_sample_draws_from_the_real_rows_of_a_padded_step(tiny_checkpoint, monkeypatch, with_tokens):
    """GpuEngine.sample over a stand-in: the tail's outputs of a padded verify step (4 x 3 rows), of which rows
    0, 1 and 3 are the step's draws; a drafter's feature rows come back with the tokens, in one wait, or (past
    FEATURES_WITH_TOKENS) on their own."""
    from pegainfer.ir import FP32
    from pegainfer.ir.step import sampler_outputs
    from pegainfer.runtime.gpu import engine as engine_module
    from pegainfer.runtime.gpu.abi import DeviceTensor

    model = load_model(tiny_checkpoint)
    graph = lower(model.spec.graph)[0]
    names = sampler_outputs(graph)
    engine = GpuEngine.__new__(GpuEngine)
    engine.rng, engine.vocab_size = np.random.default_rng(0), model.spec.config.vocab_size
    rows_out = DeviceTensor.contiguous(0x1000, (12, 2), FP32)  # a drafter's row a token, of the padded step
    features = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
    fetched = {names["sampled_ids"]: np.arange(100, 112, dtype=np.int32),
               names["sampled_logprobs"]: -np.arange(12, dtype=np.float32), rows_out: features}
    waits: list[list] = []
    engine.executor = types.SimpleNamespace(
        graph=graph, fetch=lambda tensor: waits.append([tensor]) or fetched[tensor],
        fetch_later=lambda tensors: lambda: waits.append(list(tensors)) or [fetched[t] for t in tensors])
    engine.token_output = "features"
    monkeypatch.setattr(engine_module, "FEATURES_WITH_TOKENS", 1 << 18 if with_tokens else 64)
    tokens = verify_rows(np.array([2, 1]), 3)
    engine._run = lambda chunks, all_logits, sampling, fill_late, verify, inputs: (
        {n: n for n in fetched if isinstance(n, str)} | {"logits": None, "features": rows_out}, np.array([0, 1, 3]),
        tokens)
    chunks = [Chunk(Sequence(0, [1, 2, 3]), 2, draws=2), Chunk(Sequence(1, [4]), 1)]
    result = engine.sample(chunks, [SamplingParams()] * 3, [0, 1, 0])
    assert result.tokens == [100, 101, 103]
    assert result.features.tolist() == features[[0, 1, 3]].tolist()  # the step's tokens' rows, in its order
    assert len(waits) == (1 if with_tokens else 2) and (rows_out in waits[0]) == with_tokens


@pytest.mark.parametrize("draws", [3, 1])
def test_a_recurrent_models_verify_step_of_full_width_sequences_pads_whole_sequences_only(checkpoint_factory, draws):
    """Qwen3.5 (Gated DeltaNet layers): every sequence K + 1 tokens, padded with sequences of the padding state
    slot: the real rows' logits and every real sequence's state and KV are those of the step unpadded."""
    model = load_model(checkpoint_factory("qwen3_5_hybrid"))
    engines = []
    for _ in range(2):
        engine = ReferenceEngine(model, max_tokens=512, block_size=4, max_seqs=8)
        holder = Sequence(99, [1])  # takes the padding slot, as the GPU engine's allocator keeps it from sequences
        engine.step([Chunk(holder, 1)])
        seqs = [Sequence(i, list(p)) for i, p in enumerate(PROMPTS)]
        engine.step([Chunk(s, len(s.token_ids) - 1) for s in seqs])
        for seq in seqs:
            seq.token_ids += [11, 12]
        engines.append((engine, seqs, holder))
    (plain, plain_seqs, _), (padded, padded_seqs, holder) = engines
    assert holder.table.state_slot == PADDING_SLOT and all(s.table.state_slot != PADDING_SLOT for s in padded_seqs)
    expected = plain.execute(pack_step([Chunk(s, 3, draws=draws) for s in plain_seqs], plain.allocator))[0]
    wide, rows = pad_verify_step(pack_step([Chunk(s, 3, draws=draws) for s in padded_seqs], padded.allocator),
                                 bucket=4, width=3)
    assert wide[STATE_SLOTS].tolist() == [s.table.state_slot for s in padded_seqs] + [PADDING_SLOT]
    found = padded.execute(wide)[0]
    assert len(rows) == 3 * draws
    np.testing.assert_allclose(found[rows], expected, rtol=1e-5, atol=1e-4)
    for name, pool in plain._kv_pools().items():
        rows = [s.table.state_slot for s in plain_seqs] if name in plain.pooled else slice(None)
        np.testing.assert_allclose(padded._kv_pools()[name][rows], pool[rows], rtol=1e-5, atol=1e-5, err_msg=name)
    with pytest.raises(AssertionError, match="cannot take padding tokens"):
        pad_verify_step(pack_step([Chunk(s, 1, draws=1) for s in padded_seqs], padded.allocator), bucket=4, width=3)
