"""Sampling inside the step: the `sample` op (ir/ops/sampling.py), its Triton kernels under the CPU interpreter,
and the engines' `sample` call. Philox against Random123's published answers; the op's properties (greedy and
top_k=1 are argmax, every token inside its min-p/top-k/top-p set, seeds reproduce and differ, draws follow
softmax(logits / T)); the kernels draw the op's tokens exactly for mixed per-row parameters; rows whose set
reaches past the candidates fall back to the host and get the token unlimited candidates give."""

import dataclasses
import types

import numpy as np
import pytest
import torch

import pegainfer.backends.triton.plan as plan
import pegainfer.passes.fusion as fusion
from pegainfer.backends.triton.execute import launch_kernel, to_numpy, to_torch
from pegainfer.backends.triton.loader import load_kernel_module, triton_interpret
from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.triton.launches import KERNELS
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.errors import RequestError
from pegainfer.frontends.load import load_model
from pegainfer.ir import BF16, FP32, GraphBuilder
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.ops.penalties import Penalties
from pegainfer.ir.ops.sampling import UNRESOLVED, gumbel, philox4x32, sample_row
from pegainfer.ir.registry import get_op
from pegainfer.ir.step import (PENALTY_COUNT, PENALTY_ENTRIES, PENALTY_IDS, PENALTY_START, PENALTY_TERMS,
                                SAMPLING_INPUTS, TOKEN_BITMASK, TOKEN_MASK_INDEX, TOP_LOGPROBS, mask_words,
                                sampler_outputs)
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence, pack_step
from pegainfer.runtime.constraint import PenaltyState, pack_mask
from pegainfer.runtime.device_sampling import finish, greedy_inputs, no_penalties, sampling_inputs, stack_masks
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.engine import GpuEngine
from pegainfer.runtime.gpu.step_padding import pad_decode_step
from pegainfer.runtime.kv_blocks import BlockAllocator
from pegainfer.runtime.offline import generate_one
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams

# Random123's known answers for Philox4x32-10: (counter, key, output).
PHILOX_KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
              ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
              ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
               (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
CHI2_5DOF_P1E4 = 25.74  # the chi-square critical value for 5 degrees of freedom at p = 1e-4


def params_of(inputs: dict[str, np.ndarray], row: int) -> tuple:
    return tuple(inputs[name][row].item() for name in SAMPLING_INPUTS)


def rows_of(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, step=0,
            top_logprobs=0) -> dict[str, np.ndarray]:
    values = dict(zip(SAMPLING_INPUTS, (temperature, top_k, top_p, min_p, seed, step)))
    inputs = {name: np.broadcast_to(np.asarray(values[name]), (rows,)).astype(t.dtype.np_dtype)
              for name, t in SAMPLING_INPUTS.items()}
    return inputs | {TOP_LOGPROBS: np.broadcast_to(top_logprobs, rows).astype(np.int32)}


def ranked_ids(x: np.ndarray, k: int, wanted: np.ndarray) -> np.ndarray:
    """The top-k ids a row that wants them gets (ties to the lower id); another row gets its argmax and -1s."""
    ids = np.argsort(-x, axis=1, kind="stable")[:, :k].astype(np.int32)
    ids[wanted == 0, 1:] = -1
    return ids


def draw(logits: np.ndarray, inputs: dict[str, np.ndarray], candidates: int = 64) -> tuple[np.ndarray, np.ndarray]:
    return get_op("sample").reference(logits, *(inputs[name] for name in SAMPLING_INPUTS), candidates=candidates)


def allowed_set(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens min-p, then top-k, then top-p keep, from their definitions in float64."""
    order = np.argsort(-x, kind="stable")
    probs = np.exp((x[order] - x[order[0]]) / np.float64(temperature))
    keep = probs >= min_p * probs[0]
    if 0 < top_k < x.size:
        keep[top_k:] = False
    kept = probs * keep
    before = np.cumsum(kept) - kept
    keep &= (before < (top_p - 1e-6) * kept.sum()) | (np.arange(x.size) == 0)
    return {int(t) for t in order[keep]}


# --- the random numbers -------------------------------------------------------------------------------------------

def test_philox_matches_random123_known_answers():
    for counter, key, expected in PHILOX_KAT:
        words = philox4x32(tuple(np.array([c]) for c in counter), tuple(np.array(k) for k in key))
        assert [int(w[0]) for w in words] == list(expected)


def test_kernel_noise_is_the_reference_noise():
    """The template's Philox and Gumbel transform, run by a probe kernel, give the reference's bits exactly."""
    probe = (KERNELS / "sampling.py").read_text() + '''

@triton.jit
def probe_kernel(seed_ptr, step_ptr, out_ptr, N: tl.constexpr):
    ids = tl.arange(0, N) * 7919
    tl.store(out_ptr + tl.arange(0, N), _gumbel(tl.load(seed_ptr), tl.load(step_ptr), ids))
'''
    module = load_kernel_module(probe, "sampling_probe.py", interpret=True)
    for seed, step in ((0, 0), (2 ** 64 - 3, 5), (123456789012345, 2 ** 31 - 1)):
        out = torch.empty(256, dtype=torch.float32)
        seed_array = np.array([seed], dtype=np.uint64).view(np.int64)
        with triton_interpret(True):
            module.probe_kernel[(1,)](to_torch(seed_array), to_torch(np.array([step], np.int32)), out, N=256)
        expected = gumbel(seed, step, np.arange(256) * 7919)
        np.testing.assert_array_equal(out.numpy(), expected)
        assert np.isfinite(expected).all()


def test_noise_depends_on_seed_step_and_token():
    ids = np.arange(1000)
    base = gumbel(1, 0, ids)
    for other in (gumbel(2, 0, ids), gumbel(1, 1, ids), gumbel(1, 0, ids + 1000)):
        assert np.mean(base == other) < 0.01
    assert abs(base.mean() - 0.5772) < 0.1 and abs(base.std() - 1.2825) < 0.1  # Gumbel(0, 1): Euler's gamma, pi/sqrt6


# --- the op's properties ------------------------------------------------------------------------------------------

def test_greedy_and_top_k_1_are_argmax_ties_to_the_lower_id():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (40, 300)).astype(np.float32)
    logits[0, [7, 100]] = logits[0].max() + 1  # a tie for the top
    argmax = np.argmax(logits, axis=1)
    tokens, _ = draw(logits, rows_of(40, temperature=0.0, seed=np.arange(40)))
    np.testing.assert_array_equal(tokens, argmax)
    assert tokens[0] == 7
    tokens, _ = draw(logits, rows_of(40, temperature=1.5, top_k=1, seed=np.arange(40)))
    np.testing.assert_array_equal(tokens, argmax)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0), (0.7, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.2), (1.0, 10, 0.8, 0.05), (2.0, 3, 0.6, 0.0)])
def test_every_token_lies_in_its_allowed_set(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (200, 50)).astype(np.float32)
    inputs = rows_of(200, temperature, top_k, top_p, min_p, seed=rng.integers(0, 2 ** 62, 200))
    tokens, _ = draw(logits, inputs)
    for row, token in enumerate(tokens):
        allowed = allowed_set(logits[row].astype(np.float64), temperature, top_k, top_p, min_p)
        assert token in allowed, (row, token, allowed)
    assert (tokens != logits.argmax(axis=1)).mean() > 0.1, "the sets leave a choice, and it is taken"


def test_same_seed_same_tokens_different_seeds_different_streams():
    logits = np.zeros((1, 1000), dtype=np.float32)

    def stream(seed: int) -> list[int]:
        return [int(draw(logits, rows_of(1, seed=seed, step=step))[0][0]) for step in range(20)]

    assert stream(7) == stream(7)
    assert stream(7) != stream(8)
    assert len(set(stream(7))) > 15, "steps of one stream draw afresh"


def _chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=probs.size)
    expected = probs * tokens.size
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_softmax_of_logits_over_temperature():
    """20000 rows with their own seeds over six tokens; a chi-square against softmax(x / T) that a sampler
    ignoring the temperature fails."""
    logits = np.array([[1.0, 0.2, -0.5, 0.7, -2.0, 0.0]], dtype=np.float32).repeat(20000, axis=0)
    tokens, _ = draw(logits, rows_of(20000, temperature=0.7, seed=np.arange(20000) * 977 + 3))
    scaled = np.exp(logits[0].astype(np.float64) / 0.7)
    assert _chi_square(tokens, scaled / scaled.sum()) < CHI2_5DOF_P1E4
    plain = np.exp(logits[0].astype(np.float64))
    assert _chi_square(tokens, plain / plain.sum()) > 10 * CHI2_5DOF_P1E4


def test_truncated_draws_follow_the_renormalised_distribution():
    """top_k=4 over seven tokens: the draws follow the top four renormalised (3 degrees of freedom)."""
    logits = np.array([[0.5, 1.0, -1.0, 0.2, 0.9, -0.3, 0.0]], dtype=np.float32).repeat(6000, axis=0)
    tokens, _ = draw(logits, rows_of(6000, temperature=1.0, top_k=4, seed=np.arange(6000)))
    kept = [1, 4, 0, 3]
    assert set(np.unique(tokens)) == set(kept)
    probs = np.exp(logits[0, kept].astype(np.float64))
    counts = np.array([(tokens == t).sum() for t in kept])
    chi2 = float(((counts - probs / probs.sum() * 6000) ** 2 / (probs / probs.sum() * 6000)).sum())
    assert chi2 < 21.11  # 3 degrees of freedom at p = 1e-4


def test_logprob_is_of_the_unscaled_distribution():
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 2, (30, 80)).astype(np.float32)
    tokens, logprobs = draw(logits, rows_of(30, temperature=1.7, top_p=0.9, seed=np.arange(30)))
    x = logits.astype(np.float64)
    expected = x[np.arange(30), tokens] - np.log(np.exp(x).sum(axis=1))
    np.testing.assert_allclose(logprobs, expected, atol=1e-5)


def test_rows_past_the_candidates_are_left_to_the_host_which_draws_as_unlimited_candidates_would():
    """A flat row with top_p 0.99 keeps more than 8 candidates: unresolved with 8, resolved with the vocabulary,
    and `sample_row` without a limit gives that token. Rows settled within the candidates agree either way."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 0.1, (6, 100)).astype(np.float32)
    logits[3:] = rng.normal(0, 20, (3, 100))  # peaked rows: top-p 0.99 stays within a few tokens
    inputs = rows_of(6, temperature=1.0, top_p=0.99, seed=np.arange(6))
    limited, _ = draw(logits, inputs, candidates=8)
    unlimited, _ = draw(logits, inputs, candidates=100)
    assert (limited[:3] == UNRESOLVED).all() and (limited[3:] != UNRESOLVED).all()
    np.testing.assert_array_equal(limited[3:], unlimited[3:])
    for row in range(6):
        assert sample_row(logits[row], *params_of(inputs, row)) == unlimited[row]


@pytest.mark.parametrize("top_k,min_p,resolved", [(20, 0.0, False), (20, 0.99, True), (5, 0.0, True)])
def test_top_k_past_the_candidates_is_unresolved_unless_min_p_cuts_first(top_k, min_p, resolved):
    logits = np.random.default_rng(6).normal(0, 0.5, (1, 100)).astype(np.float32)
    tokens, _ = draw(logits, rows_of(1, top_k=top_k, min_p=min_p, seed=3), candidates=8)
    assert (tokens[0] != UNRESOLVED) == resolved
    if resolved:
        assert tokens[0] == sample_row(logits[0], 1.0, top_k, 1.0, min_p, 3, 0)


# --- the kernels, under Triton's interpreter -----------------------------------------------------------------------

@dataclasses.dataclass
class Tail:
    node: object
    spec: object


def plan_tail(vocab: int, dtype, monkeypatch, candidates: int, chunk: int) -> Tail:
    """The LM-head tail kernel of a graph that is a linear alone, with `candidates` top-k candidates and vocabulary
    chunks of `chunk` entries (small values keep the interpreter quick and still cover every path)."""
    monkeypatch.setattr(fusion, "TAIL_TOP_K", candidates)
    monkeypatch.setattr(plan, "TAIL_CHUNK", chunk)
    b = GraphBuilder("head")
    x = b.input("x", dtype, ("samples", 4))
    lowered, _ = lower(b.finish(b.linear(x, b.param("w", dtype, (vocab, 4)), name="logits")))
    (node,) = [n for n in lowered.nodes if n.op == KERNEL]
    return Tail(node, plan_kernel(lowered, node, PlanOptions()))


def run_tail(tail: Tail, logits: np.ndarray, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tail's launches on given logits; `inputs` may leave the grammar masks and the penalties out (none)."""
    unmasked = {TOKEN_BITMASK: np.zeros((1, 1), np.int32), TOKEN_MASK_INDEX: np.full(logits.shape[0], -1, np.int32)}
    defaults = unmasked | no_penalties(logits.shape[0])
    env = {"logits": to_torch(logits)} | {name: to_torch(a) for name, a in (defaults | inputs).items()}
    got = launch_kernel(tail.spec, tail.node, env, {"samples": logits.shape[0]}, module="sampling.py")
    return {name: to_numpy(t) for name, t in got.items()}


def mixed_rows(rng: np.random.Generator, vocab: int) -> dict[str, np.ndarray]:
    """One row per path: greedy; whole-vocabulary Gumbel at two temperatures; top-k 1 and 5; top-p on the whole
    vocabulary's mass and after top-k; min-p alone and with top-p; top-k past the candidates; a flat top-p."""
    table = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.4, -1, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (0.8, 5, 1.0, 0.0),
             (0.5, 0, 0.5, 0.0), (1.2, 6, 0.7, 0.0), (1.0, 0, 1.0, 0.3), (0.9, 0, 0.8, 0.1), (1.0, 30, 1.0, 0.0),
             (3.0, 0, 0.995, 0.0), (1.0, vocab + 5, 0.9, 0.0)]
    temperature, top_k, top_p, min_p = (np.array(column) for column in zip(*table))
    return rows_of(len(table), temperature, top_k, top_p, min_p, seed=rng.integers(0, 2 ** 63, len(table)),
                   step=rng.integers(0, 1000, len(table)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["f32", "bf16"])
def test_kernels_draw_the_reference_tokens_for_mixed_rows(dtype, monkeypatch):
    """Two vocabulary chunks (the second one short), eight candidates: every path of both launches."""
    rng = np.random.default_rng(7)
    vocab = 80
    tail = plan_tail(vocab, dtype, monkeypatch, candidates=8, chunk=64)
    inputs = mixed_rows(rng, vocab) | {TOP_LOGPROBS: np.array([0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 1], np.int32)}
    logits = rng.normal(0, 2, (12, vocab)).astype(dtype.np_dtype)
    logits[2, [40, 70]] = logits[2].max() + 1  # a tie for the top at a low temperature
    got = run_tail(tail, logits, inputs)
    tokens, logprobs = draw(logits.astype(np.float32), inputs, candidates=8)
    np.testing.assert_array_equal(got["sampled_ids"], tokens)
    np.testing.assert_allclose(got["sampled_logprobs"], logprobs, atol=1e-5)
    assert tokens[5] != UNRESOLVED, "top-p settled within the candidates by the whole vocabulary's mass"
    assert (tokens[[9, 10]] == UNRESOLVED).all(), "top-k and top-p past the candidates"
    x = logits.astype(np.float64)
    np.testing.assert_allclose(got["logsumexp"], np.log(np.exp(x).sum(axis=1)), rtol=1e-6)
    # only rows 2 and 11 ask top logprobs: the others keep their largest alone, ranked for the draw (3-10) or not
    np.testing.assert_array_equal(got["top_ids"], ranked_ids(x, 8, inputs[TOP_LOGPROBS]))
    assert (got["top_values"][[0, 1, 5], 1:] == -np.inf).all()
    np.testing.assert_array_equal(got["top_values"][:, 0], x.max(axis=1).astype(np.float32))


@pytest.mark.slow
def test_candidates_past_the_chunk_maxima_floor_are_those_of_a_whole_ranking(monkeypatch):
    """Eighteen chunks of 64 (blocks seen as 4 x 16) and sixteen candidates, so that only keys at or above the
    16th largest chunk maximum are merged and the merge ranks 8 a chunk where none has more: a row whose top ten
    lie in one chunk, three to a column (a crowded block, and a chunk past the 8), a row of ties (the lower ids
    first), a row whose top values fill one chunk, a row masked to three ids, and random rows; the top-k,
    logsumexp and tokens are the references'."""
    rng = np.random.default_rng(23)
    vocab = 1100
    tail = plan_tail(vocab, FP32, monkeypatch, candidates=16, chunk=64)
    launches = {l.function: l for v in tail.spec.variants for l in v.launches}
    assert (launches["tail_bound_kernel"].constexprs["CHUNKS"], launches["tail_bound_kernel"].constexprs["BLOCK"],
            launches["tail_merge_kernel"].constexprs["LEAD"]) == (18, 64, 8)
    logits = rng.normal(0, 2, (8, vocab)).astype(np.float32)
    crowded = 3 * 64 + np.array([0, 16, 32, 1, 17, 33, 2, 18, 34, 48])
    logits[0, crowded] = 10 + np.arange(10)
    logits[1] = 1.0
    logits[2, 5 * 64:6 * 64] += 12
    inputs = rows_of(8, temperature=np.array([0.0, 1.0, 0.0, 0.7, 1.0, 0.0, 0.5, 1.0]),
                     top_k=np.array([0, 3, 0, 2, 0, 0, 12, 0]), top_p=np.array([1.0, 1.0, 1.0, 1.0, 0.8, 1, 1, 1]),
                     seed=rng.integers(0, 2 ** 63, 8), step=rng.integers(0, 1000, 8), top_logprobs=5)
    allowed = np.zeros(vocab, bool)
    allowed[[7, 300, 1099]] = True
    bitmask, index = stack_masks({3: pack_mask(allowed)}, 8, mask_words(vocab))
    got = run_tail(tail, logits, inputs | {TOKEN_BITMASK: bitmask, TOKEN_MASK_INDEX: index})
    masked = get_op("mask_tokens").reference(logits, bitmask, index)
    tokens, logprobs = draw(masked, inputs, candidates=16)
    np.testing.assert_array_equal(got["sampled_ids"], tokens)
    np.testing.assert_allclose(got["sampled_logprobs"], logprobs, atol=1e-5)
    np.testing.assert_array_equal(got["top_ids"], np.argsort(-masked, axis=1, kind="stable")[:, :16])
    np.testing.assert_allclose(got["logsumexp"], np.log(np.exp(masked.astype(np.float64)).sum(axis=1)), rtol=1e-6)
    assert got["top_ids"][0, :10].tolist() == crowded[::-1].tolist()
    assert got["top_ids"][1].tolist() == list(range(16)) and tokens[3] in (7, 300, 1099)


@pytest.mark.slow
def test_kernels_draw_under_each_rows_grammar_mask_as_the_reference_does(monkeypatch):
    """Rows of every sampling path under masks (one id, a few, most; a row without), two chunks: the top-k, the
    logsumexp and the draw are those of the masked logits (mask_tokens, then the ops' references), and no row
    draws an id its mask leaves out."""
    rng = np.random.default_rng(17)
    vocab = 80
    tail = plan_tail(vocab, FP32, monkeypatch, candidates=8, chunk=64)
    inputs = mixed_rows(rng, vocab) | {TOP_LOGPROBS: (np.arange(12) > 2).astype(np.int32)}
    logits = rng.normal(0, 2, (12, vocab)).astype(np.float32)
    allowed = rng.random((12, vocab)) < np.array([0.02, 0.1, 0.5, 0.9] * 3)[:, None]
    allowed[np.arange(12), rng.integers(0, vocab, 12)] = True  # at least one id a row
    masks = {row: pack_mask(allowed[row]) for row in range(12) if row != 4}
    bitmask, index = stack_masks(masks, 12, mask_words(vocab))
    got = run_tail(tail, logits, inputs | {TOKEN_BITMASK: bitmask, TOKEN_MASK_INDEX: index})
    masked = get_op("mask_tokens").reference(logits, bitmask, index)
    tokens, logprobs = draw(masked, inputs, candidates=8)
    np.testing.assert_array_equal(got["sampled_ids"], tokens)
    np.testing.assert_allclose(got["sampled_logprobs"], logprobs, atol=1e-5)
    drawn = (tokens != UNRESOLVED) & (index >= 0)
    assert allowed[np.arange(12)[drawn], tokens[drawn]].all() and drawn.sum() >= 7
    finite = np.isfinite(masked).sum(axis=1) >= 8  # rows with 8 allowed ids rank them all
    ranked = ranked_ids(masked, 8, inputs[TOP_LOGPROBS])  # rows 0-2 ask no top logprobs
    np.testing.assert_array_equal(got["top_ids"][finite], ranked[finite])
    np.testing.assert_allclose(got["logsumexp"], np.log(np.exp(masked.astype(np.float64)).sum(axis=1)), rtol=1e-6)


@pytest.mark.slow
def test_kernels_draw_penalised_rows_as_the_reference_does(monkeypatch):
    """Rows of every sampling path with sparse penalties (biases, repetition factors, subtrahends, masked ids;
    entries within one block and across chunks; a row without), some under grammar masks, one whose penalties
    mask every id its grammar allows: the top-k is of the penalised logits, the logsumexp and the logprobs of
    the masked ones (vLLM's raw logprobs), the draw the reference's, and the fully masked row left to the host."""
    rng = np.random.default_rng(29)
    vocab = 300
    tail = plan_tail(vocab, BF16, monkeypatch, candidates=8, chunk=64)
    inputs = mixed_rows(rng, vocab) | {TOP_LOGPROBS: (np.arange(12) > 2).astype(np.int32)}
    logits = rng.normal(0, 2, (12, vocab)).astype(BF16.np_dtype)
    starts, counts, ids, terms = [], [], [], []
    for row in range(12):
        chosen = np.sort(rng.choice(vocab, int(rng.integers(1, 40)), replace=False)) if row != 3 else np.array([], int)
        starts.append(len(ids))
        counts.append(chosen.size)
        ids += chosen.tolist()
        for _ in chosen:
            terms.append([rng.choice([0.0, 3.0, -2.5]), rng.choice([1.0, 1.3, 0.7]),
                          rng.choice([0.0, 0.4, -1.0, np.inf], p=[0.4, 0.3, 0.2, 0.1])])
    allowed = np.zeros(vocab, bool)
    allowed[[5, 77]] = True
    ids_of_7 = slice(starts[7], starts[7] + counts[7])
    ids[ids_of_7] = [5, 77] + [j for j in ids[ids_of_7] if j not in (5, 77)][: counts[7] - 2]
    order = np.argsort(ids[ids_of_7])
    ids[ids_of_7] = np.asarray(ids[ids_of_7])[order].tolist()
    terms[ids_of_7] = [terms[starts[7] + i] for i in order]
    for i, j in enumerate(ids[ids_of_7]):
        if j in (5, 77):
            terms[starts[7] + i][2] = np.inf  # the row's penalties mask all its grammar allows
    penalties = {PENALTY_START: np.array(starts, np.int32), PENALTY_COUNT: np.array(counts, np.int32),
                 PENALTY_IDS: np.array(ids, np.int32), PENALTY_TERMS: np.array(terms, np.float32)}
    bitmask, index = stack_masks({7: pack_mask(allowed), 9: pack_mask(rng.random(vocab) < 0.5)}, 12,
                                 mask_words(vocab))
    got = run_tail(tail, logits, inputs | penalties | {TOKEN_BITMASK: bitmask, TOKEN_MASK_INDEX: index})
    masked = get_op("mask_tokens").reference(logits.astype(np.float32), bitmask, index)
    penalized = get_op("penalize_tokens").reference(masked, *penalties.values())
    tokens, logprobs = get_op("sample").reference(penalized, *(inputs[name] for name in SAMPLING_INPUTS), masked,
                                                  candidates=8)
    np.testing.assert_array_equal(got["sampled_ids"], tokens)
    np.testing.assert_allclose(got["sampled_logprobs"], logprobs, atol=1e-5)
    assert tokens[7] == UNRESOLVED and (tokens[[0, 1, 2, 3, 4]] != UNRESOLVED).all()
    np.testing.assert_array_equal(got["top_ids"], ranked_ids(penalized, 8, inputs[TOP_LOGPROBS]))
    np.testing.assert_allclose(got["logsumexp"], np.log(np.exp(masked.astype(np.float64)).sum(axis=1)), rtol=1e-6)


def test_finish_draws_a_masked_row_left_to_the_host_under_its_mask_and_tells_the_grammar():
    """A row the tail left unresolved under a grammar mask is drawn on the host from its row with the mask
    applied; its constraint hears the token once; a row whose constraint adjusts the logits is drawn by it."""
    logits = np.random.default_rng(3).normal(0, 0.1, (1, 100)).astype(np.float32)
    allowed = np.zeros(100, bool)
    allowed[[5, 50, 95]] = True
    seen = []

    class Grammar:
        def allowed(self, vocab_size):
            return allowed

        def accept(self, token):
            seen.append(token)
    inputs = rows_of(1, temperature=1.0, top_p=0.99, seed=np.array([4]))
    outputs = {"sampled_ids": np.array([UNRESOLVED], np.int32), "sampled_logprobs": np.array([np.nan], np.float32)}
    result = finish(outputs, inputs, [SamplingParams(temperature=1.0, top_p=0.99)], lambda row: logits[row],
                    [Grammar()], {0: pack_mask(allowed)})
    x = np.where(allowed, logits[0], -np.inf).astype(np.float32)
    assert result.tokens == [sample_row(x, *params_of(inputs, 0))] and seen == result.tokens
    assert result.tokens[0] in (5, 50, 95) and result.host_rows == [0]


@pytest.mark.slow
def test_kernels_with_the_default_64_candidates_in_one_chunk(monkeypatch):
    rng = np.random.default_rng(8)
    tail = plan_tail(100, FP32, monkeypatch, candidates=64, chunk=4096)
    inputs = rows_of(4, temperature=np.array([0.0, 1.0, 1.0, 0.8]), top_k=np.array([0, 0, 50, 0]),
                     top_p=np.array([1.0, 1.0, 0.95, 0.9]), seed=rng.integers(0, 2 ** 63, 4))
    logits = rng.normal(0, 3, (4, 100)).astype(np.float32)
    got = run_tail(tail, logits, inputs)
    tokens, logprobs = draw(logits, inputs, candidates=64)
    assert (tokens != UNRESOLVED).all()
    np.testing.assert_array_equal(got["sampled_ids"], tokens)
    np.testing.assert_allclose(got["sampled_logprobs"], logprobs, atol=1e-5)


def test_host_resolves_what_the_kernels_leave_with_top_logprobs(monkeypatch):
    """A flat row with top_p 0.995 needs more than the 8 candidates: the kernel says -1, `finish` draws it from
    the full row (the token unlimited candidates give) and reports top logprobs from the candidates."""
    rng = np.random.default_rng(9)
    tail = plan_tail(100, FP32, monkeypatch, candidates=8, chunk=128)
    logits = rng.normal(0, 0.2, (2, 100)).astype(np.float32)
    logits[1] *= 200  # peaked: settled within the candidates
    inputs = rows_of(2, top_p=0.995, seed=np.array([11, 12]), top_logprobs=3)
    got = run_tail(tail, logits, inputs)
    assert got["sampled_ids"][0] == UNRESOLVED and got["sampled_ids"][1] != UNRESOLVED
    params = [SamplingParams(temperature=1.0, top_p=0.995, logprobs=3)] * 2
    result = finish(got, inputs, params, lambda row: logits[row])
    assert result.host_rows == [0]
    assert result.tokens == draw(logits, inputs, candidates=100)[0].tolist()
    lse = np.log(np.exp(logits.astype(np.float64)).sum(axis=1))
    for row in range(2):
        top = np.argsort(-logits[row], kind="stable")[:3]
        expected = {int(t): logits[row, t] - lse[row] for t in [*top, result.tokens[row]]}
        assert list(result.logprobs[row]) == list(expected)
        np.testing.assert_allclose(list(result.logprobs[row].values()), list(expected.values()), atol=1e-5)


# --- the engines ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan")])
def test_min_p_is_validated(value):
    with pytest.raises(RequestError, match=r"^min_p must be in \[0, 1\], got"):
        SamplingParams(min_p=value).validate()
    SamplingParams(min_p=0.3).validate()


def test_sampling_inputs_and_decode_padding():
    params = [SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, seed=2 ** 64 + 5, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=2 ** 40)]
    inputs = sampling_inputs(params, [3, 0], np.random.default_rng(0))
    assert inputs["sampling_top_k"].tolist() == [0, 2 ** 31 - 1]
    assert inputs["sampling_seed"][0] == 5 and inputs["sampling_step"].tolist() == [3, 0]
    assert inputs["sampling_min_p"][0] == np.float32(0.1) and inputs["sampling_top_p"][1] == 1.0
    with pytest.raises(ValueError, match="token indices"):
        sampling_inputs(params, [0, -1], np.random.default_rng(0))
    allocator = BlockAllocator(num_blocks=8, block_size=4, reserved=1)
    seqs = [Sequence(i, [1, 2]) for i in range(2)]
    step = pad_decode_step(pack_step([Chunk(s, 2) for s in seqs], allocator) | inputs, 4)
    for name in (*SAMPLING_INPUTS, TOP_LOGPROBS):
        assert step[name].shape == (4,) and step[name][:2].tolist() == inputs[name].tolist()
        assert step[name][2:].tolist() == greedy_inputs(2)[name].tolist()


def test_finish_reads_no_candidates_for_rows_asking_no_top_logprobs():
    """logprobs=0 (the chosen token's logprob alone, as a chat request's `logprobs: true`) and None: the step
    downloaded no top_values / top_ids, and none are read."""
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)]
    inputs = sampling_inputs(params, [0, 0], np.random.default_rng(0))
    assert inputs[TOP_LOGPROBS].tolist() == [0, 0]
    outputs = {"sampled_ids": np.array([7, 3], np.int32), "sampled_logprobs": np.array([-0.5, -1.0], np.float32)}
    result = finish(outputs, inputs, params, lambda row: pytest.fail("no row is left to the host"))
    assert result.tokens == [7, 3] and result.logprobs == [{7: -0.5}, None]


def test_declared_and_lowered_graphs_draw_the_same_tokens(tiny_checkpoint):
    """The reference engine samples the declared graph's logits on the host by the op's reference, and a lowered
    graph inside its tail kernel: the same tokens and logprobs, step after step, for mixed rows."""
    model = load_model(tiny_checkpoint)
    engines = [ReferenceEngine(model, max_tokens=256), ReferenceEngine(model, max_tokens=256,
                                                                        graph=lower(model.spec.graph)[0])]
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=2, logprobs=0),
              SamplingParams(temperature=1.2, min_p=0.05, seed=3)]
    results = []
    for engine in engines:
        seqs = [Sequence(i, [5 + i, 9, 200, 17][: i + 1]) for i in range(4)]
        chunks, drawn = [Chunk(s, len(s.token_ids)) for s in seqs], []
        for index in range(3):
            result = engine.sample(chunks, params, [index] * 4)
            drawn.append(result)
            for seq, token in zip(seqs, result.tokens):
                seq.token_ids.append(token)
            chunks = [Chunk(s, 1) for s in seqs]
        results.append(drawn)
    for declared, lowered in zip(*results):
        assert declared.tokens == lowered.tokens
        for a, b in zip(declared.logprobs, lowered.logprobs):
            assert (a is None) == (b is None)
            if a is not None:
                assert list(a) == list(b) and np.allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_generate_is_reproducible_by_seed_and_reports_the_chosen_logprob(tiny_checkpoint):
    def run(seed: int, **extra) -> dict:
        params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=8, ignore_eos=True, **extra)
        return generate_one(tiny_checkpoint, params, prompt_ids=[5, 9, 200, 17], device="cpu")

    first = run(3, logprobs=2)
    assert run(3)["token_ids"] == first["token_ids"]
    assert any(run(seed)["token_ids"] != first["token_ids"] for seed in (4, 5, 6))
    for token, step in zip(first["token_ids"], first["logprobs"]):
        assert str(token) in step and all(value <= 0 for value in step.values())


class _DeviceStandIn:
    """Device memory as host arrays at made-up addresses, for the GPU engine's host side: it records what comes
    back to the host."""

    def __init__(self, graph, arrays: dict[str, np.ndarray]) -> None:
        self.graph, self.arrays, self.fetched = graph, arrays, []
        self.limits = types.SimpleNamespace(penalties=PENALTY_ENTRIES)
        self.tensors = {}
        for index, (name, array) in enumerate(arrays.items()):
            dtype = graph.value_types()[name].dtype
            self.tensors[name] = DeviceTensor.contiguous(0x10000000 * (index + 1), array.shape, dtype)

    def read(self, tensor: DeviceTensor) -> np.ndarray:
        name = next(n for n, t in self.tensors.items() if t.ptr <= tensor.ptr < t.ptr + 0x10000000)
        base = self.tensors[name]
        first = (tensor.ptr - base.ptr) // (base.row_stride * base.dtype.itemsize)
        self.fetched.append((name, tensor.shape))
        return self.arrays[name][first: first + tensor.shape[0]]

    def fetch_all(self, tensors: list[DeviceTensor]) -> list[np.ndarray]:
        return [self.read(t) for t in tensors]

    def fetch_later(self, tensors: list[DeviceTensor]):
        return lambda: self.fetch_all(tensors)

    def fetch(self, tensor: DeviceTensor) -> np.ndarray:
        return self.read(tensor)


def test_gpu_engine_sample_downloads_tokens_and_only_the_rows_left_to_the_host(tiny_checkpoint):
    """GpuEngine.sample over a stand-in for the device: a padded bucket of 4 rows for 3 requests; it brings back
    the tokens and logprobs, the candidates only when a row asks for top logprobs, and one logits row for the one
    row the kernels left unresolved, from which it draws what unlimited candidates would."""
    model = load_model(tiny_checkpoint)
    graph = lower(model.spec.graph)[0]
    names = sampler_outputs(graph)
    vocab = model.spec.config.vocab_size
    logits = np.random.default_rng(10).normal(0, 0.01, (4, vocab)).astype(np.float32)
    inputs = rows_of(3, top_p=0.999, seed=np.array([1, 2, 3]))
    arrays = {"logits": logits, names["sampled_ids"]: np.array([5, UNRESOLVED, 7, 0], np.int32),
              names["sampled_logprobs"]: np.array([-1.0, np.nan, -2.0, 0.0], np.float32),
              names["top_values"]: np.sort(logits, axis=1)[:, ::-1][:, :64].copy(),
              names["top_ids"]: np.argsort(-logits, axis=1, kind="stable")[:, :64].astype(np.int32),
              names["logsumexp"]: np.log(np.exp(logits.astype(np.float64)).sum(axis=1)).astype(np.float32)}
    engine = GpuEngine.__new__(GpuEngine)
    engine.executor = _DeviceStandIn(graph, arrays)
    engine.rng, engine.vocab_size, launched_masks = np.random.default_rng(0), vocab, []

    uploaded = []

    def run(chunks, all_logits, sampling, fill_late, verify, inputs):  # masks, penalties filled as the layers run
        late = {} if fill_late is None else fill_late(4)
        launched_masks.append(late.get(TOKEN_MASK_INDEX))
        uploaded.append(no_penalties(4) | sampling | late)
        return engine.executor.tensors, None, slice(0, 4)
    engine._run = run
    chunks = [Chunk(Sequence(i, [1]), 1) for i in range(3)]
    params = [SamplingParams(temperature=1.0, top_p=0.999, seed=s) for s in (1, 2, 3)]
    result = engine.sample(chunks, params, [0, 0, 0])
    assert result.tokens == [5, sample_row(logits[1], *params_of(inputs, 1)), 7] and result.host_rows == [1]
    assert engine.executor.fetched == [(names["sampled_ids"], (4,)), (names["sampled_logprobs"], (4,)),
                                       ("logits", (1, vocab))]
    engine.executor.fetched = []
    params[0] = dataclasses.replace(params[0], logprobs=2)
    result = engine.sample(chunks, params, [0, 0, 0])
    assert [name for name, _ in engine.executor.fetched][2:5] == [names[r] for r in ("top_values", "top_ids",
                                                                                      "logsumexp")]
    top = np.argsort(-logits[0], kind="stable")[:2]
    assert list(result.logprobs[0]) == [*map(int, top), 5] and result.logprobs[1] is None

    class Grammar:  # allows what the tail drew for row 0; its bitmask goes to the tail, no logits row comes back
        accepted: list[int] = []

        def bitmask(self, vocab_size):
            return pack_mask(np.arange(vocab_size) == 5)

        def allowed(self, vocab_size):
            raise AssertionError("a row under a bitmask is not masked again on the host")

        def accept(self, token):
            self.accepted.append(token)
    engine.executor.fetched = []
    result = engine.sample(chunks, params, [0, 0, 0], [Grammar(), None, None])
    assert launched_masks[-1].tolist() == [0, -1, -1, -1] and Grammar.accepted == [5] and result.tokens[0] == 5
    assert ("logits", (1, vocab)) in engine.executor.fetched and len([f for f in engine.executor.fetched
                                                                     if f[0] == "logits"]) == 1  # row 1's only

    # penalties go to the tail as sparse terms and the row is drawn there; with top logprobs, on the host
    state = PenaltyState(Penalties(logit_bias=((9, -3.0),), presence=0.5), [4], vocab, stop_ids=[])
    state.accept(2)
    engine.executor.fetched = []
    params[2] = dataclasses.replace(params[2], logprobs=None)
    result = engine.sample(chunks, params, [0, 0, 0], [None, None, state])
    assert uploaded[-1][PENALTY_COUNT].tolist() == [0, 0, 2, 0] and uploaded[-1][PENALTY_IDS].tolist() == [2, 9]
    np.testing.assert_array_equal(uploaded[-1][PENALTY_TERMS], [[0.0, 1.0, 0.5], [-3.0, 1.0, 0.0]])
    assert result.tokens[2] == 7 and state.output == [2, 7] and result.host_rows == [1]
    params[2] = dataclasses.replace(params[2], logprobs=1)
    result = engine.sample(chunks, params, [0, 0, 0], [None, None, state])
    assert uploaded[-1][PENALTY_COUNT].tolist() == [0, 0, 0, 0] and result.host_rows == [1, 2]
    assert state.output == [2, 7, result.tokens[2]]
