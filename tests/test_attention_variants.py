"""Each Triton attention variant (flash_64's prefill tiles, split_kv_16, split_kv_prefetch_16, flash_16) on one
step that mixes a long prompt chunk with decode rows, under TRITON_INTERPRET, against the op's reference: the
prefill tiles are what every step with a prompt chunk of 64 or more queries runs, and the decode rows beside it are
what query tiles past a sequence's end must leave alone."""

import copy
import dataclasses

import numpy as np
import pytest

from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.spec import GridDim, VariantSpec, pick_variant
from pegainfer.backends.triton.attention import decode_rows_launch
from pegainfer.backends.triton.execute import launch_kernel, to_numpy, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.registry import get_op
from pegainfer.ir.step import launch_sizes
from pegainfer.models import qwen3
from pegainfer.passes.pipeline import lower

BLOCK_SIZE = 16
# (query lens, context lens) of a step: a prompt chunk after 9 cached tokens beside two decode rows; split-KV
# serves steps of few sequences below the prefill tiles' 64 queries (and is slow to interpret on long chunks)
LONG_CHUNK = ([70, 1, 1], [79, 40, 3])
SHORT_CHUNK = ([6, 1, 1], [15, 40, 3])
DECODE_FIRST = ([1, 1, 70], [40, 3, 79])  # the scheduler's order: decode tokens, then prompt chunks


@pytest.fixture(scope="module")
def attention():
    config = qwen3.Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                          rope_theta=1e4, attention_bias=False, tie_word_embeddings=True, torch_dtype="float32")
    lowered, _ = lower(qwen3.build_graph(config))
    graph, node = next((g, n) for g in lowered.all_graphs() for n in g.nodes
                       if n.op == KERNEL and n.attrs["kind"] == "paged_attention")
    return graph, node, plan_kernel(graph, node, PlanOptions(block_size=BLOCK_SIZE))


def step_inputs(rng: np.random.Generator, heads: int, kv_heads: int, head_dim: int, query_lens: list[int],
                context_lens: list[int]) -> dict[str, np.ndarray]:
    num_blocks = 16
    tables = rng.permutation(num_blocks)[:15].reshape(3, 5).astype(np.int32)  # disjoint blocks per sequence
    tokens = sum(query_lens)
    return {"q": rng.standard_normal((tokens, heads, head_dim)).astype(np.float32),
            "k": rng.standard_normal((num_blocks, BLOCK_SIZE, kv_heads, head_dim)).astype(np.float32),
            "v": rng.standard_normal((num_blocks, BLOCK_SIZE, kv_heads, head_dim)).astype(np.float32),
            "tables": tables, "starts": np.cumsum([0, *query_lens[:-1]]).astype(np.int32),
            "q_lens": np.array(query_lens, np.int32), "ctx_lens": np.array(context_lens, np.int32)}


@pytest.mark.parametrize("variant, step", [("flash_64", LONG_CHUNK), ("flash_16", LONG_CHUNK),
                                           ("split_kv_16", SHORT_CHUNK), ("split_kv_prefetch_16", SHORT_CHUNK)],
                         ids=["flash_64", "flash_16", "split_kv_16", "split_kv_prefetch_16"])
def test_attention_variant_matches_the_reference_on_a_mixed_step(attention, variant, step):
    """split_kv_prefetch_16 (one sequence's decode step on the GPU) reads each first tile's keys before the step's
    first position apart from those after it (before and after the wait for the previous kernel): here every
    sequence's first tile holds both."""
    check_variant(*attention, variant, step)


def test_flash_64_keeps_a_sliding_window(attention):
    """Windowed models' long prompts run these tiles (no TileLang candidate takes a window)."""
    graph, node, _ = attention
    windowed = copy.deepcopy(node)
    windowed.attrs["nodes"][0].attrs["window"] = 12  # shorter than the 70-query chunk and its 9 cached keys
    check_variant(graph, windowed, plan_kernel(graph, windowed, PlanOptions(block_size=BLOCK_SIZE)), "flash_64",
                  LONG_CHUNK)


def check_variant(graph, node, spec, variant: str, step: tuple[list[int], list[int]]) -> None:
    (inner,) = node.attrs["nodes"]
    types = graph.value_types()
    _, heads, head_dim = types[inner.inputs[0]].shape
    kv_heads = types[inner.inputs[1]].shape[2]
    values = step_inputs(np.random.default_rng(7), heads, kv_heads, head_dim, *step)
    arrays = dict(zip(inner.inputs, values.values()))
    sizes = {"tokens": sum(step[0]), "batch": 3, "num_blocks": 16, "block_size": BLOCK_SIZE, "max_blocks": 5,
             **launch_sizes(values["q_lens"])}
    if variant == "flash_64":
        assert pick_variant(spec, sizes).name == variant, "the prefill tiles serve a step with a 70-query chunk"
    (picked,) = [v for v in spec.variants if v.name == variant]
    chosen = dataclasses.replace(spec, variants=[dataclasses.replace(picked, max_rows=None, min_sizes={})])
    got = to_numpy(launch_kernel(chosen, node, {n: to_torch(a) for n, a in arrays.items()}, sizes)[inner.outputs[0]])
    expected = get_op("paged_attention").reference(*values.values(), **inner.attrs)
    np.testing.assert_allclose(got.reshape(expected.shape), expected, atol=2e-5, rtol=2e-5)


def test_split_kv_slices_past_the_keys_store_only_their_log_sum_exp(attention):
    """Slices are whole tiles of keys, so a short context leaves most of a sequence's slices without any: those
    write a log-sum-exp of -inf and leave their partial output alone (here NaN, as stale memory could be), the
    slices with keys write both, and the merge, skipping the empty ones, gives the reference's attention."""
    graph, node, spec = attention
    (inner,) = node.attrs["nodes"]
    types = graph.value_types()
    _, heads, head_dim = types[inner.inputs[0]].shape
    values = step_inputs(np.random.default_rng(7), heads, types[inner.inputs[1]].shape[2], head_dim, *SHORT_CHUNK)
    sizes = {"tokens": sum(SHORT_CHUNK[0]), "batch": 3, "num_blocks": 16, "block_size": BLOCK_SIZE, "max_blocks": 5,
             **launch_sizes(values["q_lens"])}
    (picked,) = [v for v in spec.variants if v.name == "split_kv_16"]
    chosen = dataclasses.replace(spec, variants=[dataclasses.replace(picked, max_rows=None, min_sizes={})])
    scratch = {name: to_torch(np.full([sizes.get(d, d) for d in shape], np.nan, np.float32))
               for name, (_, shape) in spec.scratch.items()}
    env = {n: to_torch(a) for n, a in zip(inner.inputs, values.values())} | scratch
    got = to_numpy(launch_kernel(chosen, node, env, sizes)[inner.outputs[0]])
    expected = get_op("paged_attention").reference(*values.values(), **inner.attrs)
    np.testing.assert_allclose(got.reshape(expected.shape), expected, atol=2e-5, rtol=2e-5)
    constexprs = picked.launches[0].constexprs
    splits, block_kv = constexprs["SPLITS"], constexprs["BLOCK_KV"]
    lse = to_numpy(scratch["attention.part_lse"]).reshape(sizes["tokens"], heads, splits)
    out = to_numpy(scratch["attention.part_out"]).reshape(sizes["tokens"], heads, splits, head_dim)
    for token, context in zip(values["starts"][1:], SHORT_CHUNK[1][1:]):  # the two one-query sequences
        span = -(-(-(-context // splits)) // block_kv) * block_kv  # the kernel's slice: whole tiles of keys
        used = -(-context // span)
        assert 1 <= used < splits, (context, span, used)  # some slices without keys
        assert np.isfinite(lse[token, :, :used]).all() and np.isfinite(out[token, :, :used]).all()
        assert (lse[token, :, used:] == -np.inf).all() and np.isnan(out[token, :, used:]).all()


def run_launches(graph, node, launches, step) -> tuple[np.ndarray, np.ndarray]:
    """(what the launches write, the op's reference) on one step; rows no launch writes stay NaN."""
    (inner,) = node.attrs["nodes"]
    types = graph.value_types()
    _, heads, head_dim = types[inner.inputs[0]].shape
    values = step_inputs(np.random.default_rng(7), heads, types[inner.inputs[1]].shape[2], head_dim, *step)
    sizes = {"tokens": sum(step[0]), "batch": 3, "num_blocks": 16, "block_size": BLOCK_SIZE, "max_blocks": 5,
             **launch_sizes(values["q_lens"])}
    spec = plan_kernel(graph, node, PlanOptions(block_size=BLOCK_SIZE))
    spec = dataclasses.replace(spec, variants=[VariantSpec("under_test", None, launches)])
    env = {n: to_torch(a) for n, a in zip(inner.inputs, values.values())}
    got = to_numpy(launch_kernel(spec, node, env, sizes)[inner.outputs[0]])
    expected = get_op("paged_attention").reference(*values.values(), **inner.attrs)
    return got.reshape(expected.shape), expected


def test_the_decode_rows_launch_writes_exactly_the_leading_one_query_sequences(attention):
    """TileLang's mixed-step variant runs this launch first: the step's first two sequences (one query each) come
    out as the reference's, and the 70-query chunk after them is left to the other launch (still NaN)."""
    graph, node, _ = attention
    got, expected = run_launches(graph, node, [decode_rows_launch(graph, node, PlanOptions(block_size=BLOCK_SIZE))],
                                 DECODE_FIRST)
    np.testing.assert_allclose(got[:2], expected[:2], atol=2e-5, rtol=2e-5)
    assert np.isnan(got[2:]).all()


def test_a_mixed_step_split_into_decode_rows_and_chunks_covers_every_row(attention):
    """The mixed variant's scheme on Triton's prefill tiles: the chunks' launch reads the per-sequence tensors from
    row decode_seqs on (Param.skip) over prefill_seqs programs, so the two launches together give the whole step."""
    graph, node, spec = attention
    options = PlanOptions(block_size=BLOCK_SIZE)
    (tiles,) = next(v for v in spec.variants if v.name == "flash_64").launches
    per_sequence = {"tables_ptr", "starts_ptr", "q_lens_ptr", "ctx_lens_ptr"}
    chunks = dataclasses.replace(
        tiles, params=[dataclasses.replace(p, skip="decode_seqs") if p.name in per_sequence else p
                       for p in tiles.params],
        grid=(GridDim(("prefill_seqs",)), *tiles.grid[1:]))
    got, expected = run_launches(graph, node, [decode_rows_launch(graph, node, options), chunks], DECODE_FIRST)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)
