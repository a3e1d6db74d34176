"""SamplingParams: its validation, and the token sets its parameters select, drawn as the engines draw them
(runtime/device_sampling.sampling_inputs into the `sample` op's reference, one seed per draw)."""

from dataclasses import replace

import numpy as np
import pytest

from pegainfer.errors import RequestError
from pegainfer.ir.ops.sampling import sample_rows
from pegainfer.ir.step import SAMPLING_INPUTS
from pegainfer.runtime.device_sampling import sampling_inputs
from pegainfer.runtime.sampler import MAX_LOGPROBS, SamplingParams

# Known probabilities, most likely first; the logits carry an arbitrary offset that softmax must ignore.
PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = (np.log(PROBS) + 3.0).astype(np.float32)


def drawn(logits: np.ndarray, params: SamplingParams, n: int = 2000) -> set[int]:
    """The tokens n draws of one row give, each under a seed of its own."""
    rows = [replace(params, seed=seed) for seed in range(n)]
    inputs = sampling_inputs(rows, [0] * n, np.random.default_rng(0))
    tokens = sample_rows(np.broadcast_to(logits, (n, logits.size)), *(inputs[name] for name in SAMPLING_INPUTS))
    return set(tokens.tolist())


# --- the token sets ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_p,kept", [
    (0.3, {0}),          # the first token alone reaches p
    (0.5, {0}),          # ... exactly
    (0.79, {0, 1}),      # 0.5 < 0.79 <= 0.8
    (0.8, {0, 1}),       # 0.5 + 0.3 reaches 0.8 exactly
    (0.81, {0, 1, 2}),   # 0.8 < 0.81 <= 0.95
    (0.96, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    assert drawn(LOGITS, SamplingParams(temperature=1.0, top_p=top_p)) == kept


def test_top_p_does_not_depend_on_token_order():
    perm = np.array([2, 0, 3, 1])  # token i of the permuted logits is token perm[i] of LOGITS
    for top_p in (0.79, 0.8):
        tokens = drawn(LOGITS[perm], SamplingParams(temperature=1.0, top_p=top_p))
        assert {int(perm[t]) for t in tokens} == {0, 1}


def test_top_p_applies_to_the_distribution_left_by_top_k():
    # Over [0.4, 0.3, 0.2, 0.1]: top_k=2 leaves [4/7, 3/7]; 4/7 alone reaches 0.55. Without top_k, 0.4 does not.
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1])).astype(np.float32)
    assert drawn(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.55)) == {0}
    assert drawn(logits, SamplingParams(temperature=1.0, top_p=0.55)) == {0, 1}


@pytest.mark.parametrize("k", [0, -1, 30, 1000])
def test_top_k_0_minus_1_or_at_least_vocab_keeps_every_token(k):
    assert drawn(np.zeros(30, dtype=np.float32), SamplingParams(temperature=1.0, top_k=k)) == set(range(30))


@pytest.mark.parametrize("min_p,kept", [(0.35, {0, 1}), (0.5, {0, 1}), (0.7, {0})])
def test_min_p_keeps_tokens_at_least_that_fraction_of_the_top(min_p, kept):
    assert drawn(LOGITS, SamplingParams(temperature=1.0, min_p=min_p)) == kept  # 0.3 / 0.5 = 0.6


def test_greedy_and_a_tiny_positive_temperature_take_the_argmax_whatever_the_cuts():
    logits = np.random.default_rng(11).normal(0, 3, 50).astype(np.float32)
    for params in (SamplingParams(top_k=5, top_p=0.1), SamplingParams(temperature=1e-45)):
        params.validate()
        assert drawn(logits, params, n=50) == {int(np.argmax(logits))}


# --- validation -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("temperature", -1e-9), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.0001), ("top_p", float("nan")),
    ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")),
    ("max_tokens", 0), ("max_tokens", -3),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 50),
    ("seed", -1),
])
def test_validate_names_the_out_of_range_parameter(field, value):
    with pytest.raises(RequestError) as error:
        SamplingParams(**{field: value}).validate()
    message = str(error.value)
    assert message.startswith(field), message
    assert repr(value) in message, message
    assert "\n" not in message


@pytest.mark.parametrize("field,value", [
    ("temperature", 0.0), ("temperature", 2.5), ("top_p", 1.0), ("top_p", 1e-6), ("top_k", -1), ("top_k", 0),
    ("top_k", 1), ("min_p", 0.0), ("min_p", 1.0), ("max_tokens", 1), ("logprobs", 0), ("logprobs", MAX_LOGPROBS),
    ("logprobs", None), ("seed", 0), ("seed", 2**40),
])
def test_validate_accepts_in_range_values(field, value):
    SamplingParams(**{field: value}).validate()
