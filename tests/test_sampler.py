"""The CPU sampler (pegainfer.runtime.sampler): greedy, temperature, top-k, top-p, seeds, top-K logprobs and the
validation of SamplingParams."""

from collections import Counter

import numpy as np
import pytest

from pegainfer.errors import RequestError
from pegainfer.runtime.sampler import MAX_LOGPROBS, SamplingParams, sample, top_logprobs

# Known probabilities, most likely first; the logits carry an arbitrary offset that softmax must ignore.
PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = (np.log(PROBS) + 3.0).astype(np.float32)


def draws(logits: np.ndarray, params: SamplingParams, n: int, seed: int = 0) -> Counter:
    rng = np.random.default_rng(seed)
    return Counter(sample(logits, params, rng) for _ in range(n))


def softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def random_logits(seed: int, size: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, size).astype(np.float32)


# --- greedy and top-k -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_greedy_picks_argmax(seed):
    logits = random_logits(seed)
    rng = np.random.default_rng(seed)
    assert all(sample(logits, SamplingParams(temperature=0.0), rng) == int(np.argmax(logits)) for _ in range(20))


def test_greedy_ignores_top_k_and_top_p():
    logits = random_logits(11)
    rng = np.random.default_rng(3)
    assert sample(logits, SamplingParams(temperature=0.0, top_k=5, top_p=0.1), rng) == int(np.argmax(logits))


def test_top_k_1_at_temperature_1_always_returns_argmax():
    logits = random_logits(1)
    counts = draws(logits, SamplingParams(temperature=1.0, top_k=1), 1000)
    assert set(counts) == {int(np.argmax(logits))}


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_never_leaves_the_top_k(k):
    # A nearly flat distribution over 30 distinct logits: without the cut, tokens outside the top k would
    # take most of the draws.
    logits = np.linspace(0.0, 1.0, 30).astype(np.float32)[np.random.default_rng(k).permutation(30)]
    top = set(np.argsort(-logits)[:k].tolist())
    counts = draws(logits, SamplingParams(temperature=1.0, top_k=k), 3000)
    assert set(counts) == top  # never outside, and every one of the top k is reachable


@pytest.mark.parametrize("k", [0, -1, 30, 1000])
def test_top_k_0_minus_1_or_at_least_vocab_keeps_every_token(k):
    logits = np.zeros(30, dtype=np.float32)
    counts = draws(logits, SamplingParams(temperature=1.0, top_k=k), 3000)
    assert set(counts) == set(range(30))


def test_top_k_renormalizes_within_the_kept_tokens():
    # top_k=2 over [0.5, 0.3, 0.15, 0.05]: 0.5/0.8 and 0.3/0.8.
    counts = draws(LOGITS, SamplingParams(temperature=1.0, top_k=2), 4000)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 4000 - 0.625) < 0.03


# --- top-p ------------------------------------------------------------------------------------------------------

def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # 0.5 + 0.3 reaches 0.8: exactly the first two tokens, both of them reachable.
    counts = draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.8), 4000)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.03


@pytest.mark.parametrize("top_p,kept", [
    (0.3, {0}),          # the first token alone reaches p
    (0.5, {0}),          # ... exactly
    (0.79, {0, 1}),      # 0.5 < 0.79 <= 0.8
    (0.81, {0, 1, 2}),   # 0.8 < 0.81 <= 0.95
    (0.96, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_prefix_for_several_p(top_p, kept):
    counts = draws(LOGITS, SamplingParams(temperature=1.0, top_p=top_p), 2000)
    assert set(counts) == kept


def test_top_p_does_not_depend_on_token_order_away_from_the_boundary():
    perm = np.array([2, 0, 3, 1])  # token i of the permuted logits is token perm[i] of LOGITS
    counts = draws(LOGITS[perm], SamplingParams(temperature=1.0, top_p=0.79), 3000)
    assert {int(perm[t]) for t in counts} == {0, 1}


def test_top_p_exact_boundary_does_not_depend_on_token_order():
    perm = np.array([2, 0, 3, 1])
    counts = draws(LOGITS[perm], SamplingParams(temperature=1.0, top_p=0.8), 4000)
    assert {int(perm[t]) for t in counts} == {0, 1}


def test_top_p_applies_to_the_distribution_left_by_top_k():
    # Over [0.4, 0.3, 0.2, 0.1]: top_k=2 leaves [4/7, 3/7]; 4/7 alone reaches 0.55. Without top_k, 0.4 does not.
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1])).astype(np.float32)
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.55), 2000)) == {0}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.55), 2000)) == {0, 1}


# --- temperature, seeds -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_frequencies_match_softmax(temperature):
    n = 20000 if temperature == 1.0 else 10000
    logits = np.array([1.0, 0.2, -0.5, 0.7, -2.0], dtype=np.float32)
    counts = draws(logits, SamplingParams(temperature=temperature), n, seed=123)
    freq = np.array([counts[t] / n for t in range(logits.size)])
    expected = softmax(logits / temperature)
    tolerance = 4 * np.sqrt(expected * (1 - expected) / n) + 1e-3  # about four standard deviations
    assert np.all(np.abs(freq - expected) < tolerance), (freq, expected)


def test_same_seed_same_draws_and_different_seed_different_draws():
    logits = np.zeros(100, dtype=np.float32)
    params = SamplingParams(temperature=1.0)

    def sequence(seed):
        rng = np.random.default_rng(seed)
        return [sample(logits, params, rng) for _ in range(50)]
    assert sequence(7) == sequence(7)
    assert sequence(7) != sequence(8)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_tiny_positive_temperature_acts_as_greedy():
    logits = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    params = SamplingParams(temperature=1e-45)
    params.validate()
    assert sample(logits, params, np.random.default_rng(0)) == 1


# --- logprobs ---------------------------------------------------------------------------------------------------

def test_top_logprobs_top_count_in_order_plus_chosen():
    logits = random_logits(5)
    expected = reference_log_softmax(logits)
    order = np.argsort(-expected)
    chosen = int(order[10])  # not among the top 3
    result = top_logprobs(logits, 3, chosen)
    assert list(result) == [int(t) for t in order[:3]] + [chosen]
    for token, value in result.items():
        assert value == pytest.approx(expected[token], abs=1e-6)
        assert value <= 0
    assert list(result.values())[:3] == sorted(list(result.values())[:3], reverse=True)


def test_top_logprobs_chosen_among_top_is_not_duplicated():
    logits = random_logits(6)
    best = int(np.argmax(logits))
    result = top_logprobs(logits, 4, best)
    assert len(result) == 4
    assert next(iter(result)) == best
    assert max(result.values()) == result[best]


def test_top_logprobs_are_of_the_logits_with_offset_ignored():
    logits = LOGITS  # log(PROBS) + 3
    result = top_logprobs(logits, 4, 0)
    assert [result[t] for t in range(4)] == pytest.approx(np.log(PROBS).tolist(), abs=1e-6)
    assert sum(np.exp(v) for v in result.values()) == pytest.approx(1.0, abs=1e-6)


def test_top_logprobs_count_0_gives_only_the_chosen_token():
    assert list(top_logprobs(random_logits(7), 0, 3)) == [3]


# --- validation -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("temperature", -1e-9), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", -0.5), ("top_p", 1.0001), ("top_p", float("nan")),
    ("top_k", -2),
    ("max_tokens", 0), ("max_tokens", -3),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 50),
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
    ("top_k", 1), ("max_tokens", 1), ("logprobs", 0), ("logprobs", MAX_LOGPROBS), ("logprobs", None),
    ("seed", 0), ("seed", 2**40),
])
def test_validate_accepts_in_range_values(field, value):
    SamplingParams(**{field: value}).validate()


def test_negative_seed_is_rejected_or_usable():
    params = SamplingParams(temperature=1.0, seed=-1)
    try:
        params.validate()
    except RequestError as error:
        assert "seed" in str(error)
        return
    np.random.default_rng(params.seed)  # the generator makes one per request from the seed
