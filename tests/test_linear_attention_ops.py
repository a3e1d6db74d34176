"""The linear-attention ops (ir/ops/linear_attention.py) against Hugging Face's Qwen3.5 functions in float32:
`gated_delta_rule` against `torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule` on packed sequences
(grouped value heads, odd head counts, states carried in from a slot), `causal_conv1d` against `causal_conv1d_fn` and
`causal_conv1d_update`; the chunked form equal to the recurrent one; a sequence cut into steps at several places
equal to it in one step; a fresh sequence ignoring what its slot holds; bad shapes refused in one line."""

import numpy as np
import pytest
import torch

from pegainfer.errors import GraphError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.ops.linear_attention import chunked_gated_delta_rule
from pegainfer.ir.registry import get_op, infer_types
from pegainfer.ir.types import TensorType

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

F32, I32 = dtype_from_name("f32"), dtype_from_name("i32")


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


def delta_inputs(rng: np.random.Generator, tokens: int, key_heads: int, value_heads: int, key_dim: int = 16,
                 value_dim: int = 8):
    q, k = (rng.standard_normal((tokens, key_heads, key_dim)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((tokens, value_heads, value_dim)).astype(np.float32)
    # as Qwen3.5 makes them: g = -exp(A_log) softplus(a + dt_bias) <= 0, beta = sigmoid(b)
    g = (-np.exp(rng.uniform(-2, 1, value_heads)) * np.log1p(np.exp(rng.standard_normal((tokens, value_heads)))))
    beta = 1 / (1 + np.exp(-rng.standard_normal((tokens, value_heads))))
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def hf_delta(fn, q, k, v, g, beta, initial):
    tensors = [torch.from_numpy(a)[None] for a in (q, k, v, g, beta)]
    out, state = fn(*tensors[:3], g=tensors[3], beta=tensors[4],
                    initial_state=None if initial is None else torch.from_numpy(initial)[None],
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0].numpy(), state[0].numpy()


def run_delta(q, k, v, g, beta, state, slots, starts, lens, contexts):
    reference = get_op("gated_delta_rule").reference
    return reference(q, k, v, g, beta, state, np.array(slots), np.array(starts), np.array(lens), np.array(contexts),
                     scale=q.shape[2] ** -0.5)


@pytest.mark.parametrize("key_heads,value_heads", [(1, 1), (1, 3), (2, 4), (3, 3)])
def test_gated_delta_rule_matches_hugging_face_on_packed_sequences_with_carried_states(key_heads, value_heads):
    rng = np.random.default_rng(key_heads * 10 + value_heads)
    lens, cached = [5, 1, 70], [0, 9, 3]  # a fresh prompt, a decode step, a chunk after three tokens
    q, k, v, g, beta = delta_inputs(rng, sum(lens), key_heads, value_heads)
    state = rng.standard_normal((4, value_heads, 16, 8)).astype(np.float32)
    slots, starts = [2, 0, 3], np.cumsum([0] + lens[:-1]).tolist()
    before = state.copy()
    state, out = run_delta(q, k, v, g, beta, state, slots, starts, lens, [c + n for c, n in zip(cached, lens)])
    for slot, start, n, c in zip(slots, starts, lens, cached):
        rows = slice(start, start + n)
        initial = None if c == 0 else before[slot]
        for fn in (hf.torch_recurrent_gated_delta_rule, hf.torch_chunk_gated_delta_rule):
            expected, final = hf_delta(fn, q[rows], k[rows], v[rows], g[rows], beta[rows], initial)
            assert relative_error(out[rows], expected) < 1e-5, (fn.__name__, slot)
            assert relative_error(state[slot], final) < 1e-5, (fn.__name__, slot)
    assert np.array_equal(state[1], before[1])  # a slot no sequence names is left as it was


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 130])
def test_the_chunked_form_equals_the_recurrent_one(tokens):
    rng = np.random.default_rng(tokens)
    q, k, v, g, beta = delta_inputs(rng, tokens, 2, 4)
    initial = rng.standard_normal((4, 16, 8)).astype(np.float32)
    state = initial[None].copy()
    state, out = run_delta(q, k, v, g, beta, state, [0], [0], [tokens], [tokens + 1])
    for chunk in (16, 64):
        chunked, final = chunked_gated_delta_rule(q, k, v, g, beta, initial, scale=16 ** -0.5, chunk=chunk)
        assert relative_error(chunked, out) < 1e-5 and relative_error(final, state[0]) < 1e-5, chunk


@pytest.mark.parametrize("cuts", [[1], [40], [64, 65], [1, 2, 3, 100]])
def test_a_sequence_cut_into_steps_equals_it_in_one_step(cuts):
    rng = np.random.default_rng(len(cuts))
    q, k, v, g, beta = delta_inputs(rng, 130, 1, 2)
    whole, whole_out = run_delta(q, k, v, g, beta, np.zeros((1, 2, 16, 8), np.float32), [0], [0], [130], [130])
    state, outs = rng.standard_normal((1, 2, 16, 8)).astype(np.float32), []  # stale: the first step ignores it
    for begin, end in zip([0, *cuts], [*cuts, 130]):
        part = slice(begin, end)
        state, out = run_delta(q[part], k[part], v[part], g[part], beta[part], state, [0], [0], [end - begin],
                               [end])
        outs.append(out)
    assert relative_error(np.concatenate(outs), whole_out) < 1e-5
    assert relative_error(state, whole) < 1e-5


def run_conv(x, weight, state, slots, starts, lens, contexts):
    return get_op("causal_conv1d").reference(x, weight, state, np.array(slots), np.array(starts), np.array(lens),
                                             np.array(contexts), activation="silu")


def test_causal_conv1d_matches_hugging_face_from_zeros_and_from_a_state():
    rng = np.random.default_rng(0)
    channels, width, lens = 6, 4, [7, 1, 2]
    x = rng.standard_normal((sum(lens), channels)).astype(np.float32)
    weight = rng.standard_normal((channels, width)).astype(np.float32)
    state = rng.standard_normal((3, channels, width - 1)).astype(np.float32)
    before = state.copy()
    state, out = run_conv(x, weight, state, [1, 0, 2], [0, 7, 8], lens, [7, 5, 12])
    w = torch.from_numpy(weight)
    fresh = hf.causal_conv1d_fn(torch.from_numpy(x[:7]).T[None], w, None, activation="silu")[0].T.numpy()
    assert relative_error(out[:7], fresh) < 1e-6
    assert np.allclose(state[1], x[4:7].T)  # the last width - 1 inputs
    for slot, rows in ((0, slice(7, 8)), (2, slice(8, 10))):
        carried = torch.from_numpy(before[slot])[None].clone()
        expected = hf.causal_conv1d_update(torch.from_numpy(x[rows]).T[None], carried, w, None, "silu")
        assert relative_error(out[rows], expected[0].T.numpy()) < 1e-6, slot
        assert np.allclose(state[slot], carried[0].numpy()), slot


def test_causal_conv1d_cut_into_steps_equals_it_in_one_step():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 5)).astype(np.float32)
    weight = rng.standard_normal((5, 4)).astype(np.float32)
    _, whole = run_conv(x, weight, np.zeros((1, 5, 3), np.float32), [0], [0], [9], [9])
    state, outs = np.full((1, 5, 3), 7.0, np.float32), []
    for begin, end in ((0, 2), (2, 3), (3, 9)):
        state, out = run_conv(x[begin:end], weight, state, [0], [0], [end - begin], [end])
        outs.append(out)
    assert relative_error(np.concatenate(outs), whole) < 1e-6


def t(*shape, dtype=F32) -> TensorType:
    return TensorType(dtype, shape)


@pytest.mark.parametrize("inputs,message", [
    ((t("tokens", 2, 16), t("tokens", 2, 16), t("tokens", 3, 8), t("tokens", 3), t("tokens", 3),
      t("slots", 3, 16, 8)), "value heads 3 must be a multiple of key heads 2"),
    ((t("tokens", 2, 16), t("tokens", 2, 16), t("tokens", 4, 8), t("tokens", 4), t("tokens", 4),
      t("slots", 4, 8, 8)), "state must be float [slots, 4, 16, 8]"),
])
def test_bad_shapes_are_refused_in_one_line(inputs, message):
    steps = [t("batch", dtype=I32)] * 4
    with pytest.raises(GraphError, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        infer_types("gated_delta_rule", [*inputs, *steps], {"scale": 0.25})
    assert "\n" not in str(error.value)
    with pytest.raises(GraphError, match=r"conv_state must be \[slots, 6, 3\]"):
        infer_types("causal_conv1d", [t("tokens", 6), t(6, 4), t("slots", 6, 4), *steps], {"activation": "silu"})
