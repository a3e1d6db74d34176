"""Speculative decoding on the CPU engine: with each proposer the tokens are those of decoding without it (greedy,
and seeded sampling too, since every draw keeps its own noise) whatever the batching, chunking and preemption;
the kept tokens follow the target's distribution (a chi-square test that a draft-distribution bug fails); an n-gram
run on a repeating output accepts most drafts and a draft model equal to the target accepts all, as /metrics counts;
bad configurations fail at start in one line."""

import json
import math
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from drain import drain
from live_server import NAME, start_server, stop_server
from pegainfer.errors import ConfigError
from pegainfer.frontends.load import load_model
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.proposers import DRAFT_WORKSPACE, DraftModelProposer, NgramProposer, make_speculator
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig
from pegainfer.runtime.speculative import Speculator, accepted_count, ngram_drafts, parse_speculative_config

NGRAM = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
REPEATING = [36, 37, 38]  # the tiny checkpoint's greedy continuation of it repeats itself: n-gram's case


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def workload(count: int = 6) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(1)
    work = []
    for i in range(count):
        prompt = rng.integers(0, 500, int(rng.integers(3, 30))).tolist()
        prompt = prompt + prompt[: len(prompt) // 2]  # something for prompt lookup to find
        sampled = SamplingParams(temperature=1.0, top_k=20, seed=100 + i, max_tokens=24, ignore_eos=True)
        work.append((prompt, replace(sampled, temperature=0.0) if i % 2 else sampled))
    return work + [(REPEATING, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2))]


def run(model, work, speculator=None, kv_tokens: int = 4096, budget: int = 512) -> tuple[dict, Scheduler]:
    scheduler = Scheduler(ReferenceEngine(model, max_tokens=kv_tokens, block_size=4), frozenset(),
                          SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256,
                                          prefix_cache=True), speculator)
    for i, (prompt, params) in enumerate(work):
        scheduler.add(EngineRequest(str(i), list(prompt), params))
    made = drain(scheduler)
    out = {str(i): [(t.token_id, t.logprobs) for t in made[str(i)]] for i in range(len(work))}
    assert scheduler.allocator.num_free + (scheduler.cache.num_evictable if scheduler.cache else 0) == \
        scheduler.allocator.num_blocks  # every block back
    return out, scheduler


def same_outputs(ours: dict, theirs: dict) -> None:
    for request, tokens in theirs.items():
        assert [t for t, _ in ours[request]] == [t for t, _ in tokens], f"request {request}"
        for (_, mine), (_, reference) in zip(ours[request], tokens):
            if reference is not None:
                assert mine.keys() == reference.keys()
                np.testing.assert_allclose(list(mine.values()), list(reference.values()), atol=1e-4)


def draft_of(model, k: int) -> Speculator:
    config = parse_speculative_config({"method": "draft_model", "num_speculative_tokens": k, "model": "x"})
    return Speculator(config, DraftModelProposer(ReferenceEngine(model, max_tokens=4096, block_size=4)))


@pytest.mark.parametrize("kv_tokens, budget", [(4096, 512), (4096, 16), (160, 48)])
def test_ngram_speculation_gives_the_tokens_of_decoding_without_it(model, kv_tokens, budget):
    """A roomy pool; a 16-token budget (chunked prefill, drafts cut to the budget); a pool so small that
    sequences are preempted and recomputed."""
    expected, _ = run(model, workload(), kv_tokens=kv_tokens, budget=budget)
    found, scheduler = run(model, workload(), Speculator(NGRAM, NgramProposer(NGRAM)), kv_tokens, budget)
    same_outputs(found, expected)
    assert scheduler.stats.spec_drafts > 0
    if kv_tokens == 160:
        assert scheduler.stats.preemptions > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_draft_model_equal_to_the_target_is_always_accepted_and_changes_nothing(model, k):
    """Greedy requests: the draft's argmax is the target's own draw."""
    greedy = [(prompt, replace(params, temperature=0.0)) for prompt, params in workload()]
    expected, _ = run(model, greedy)
    found, scheduler = run(model, greedy, draft_of(model, k))
    same_outputs(found, expected)
    stats = scheduler.stats
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert stats.spec_accepted_by_position[0] == stats.spec_drafts and max(stats.spec_accepted_by_position) == k - 1


def test_a_draft_model_with_preemption_and_chunks_changes_nothing(model, checkpoint_factory):
    other = load_model(checkpoint_factory("tiny_seed5", seed=5))  # another model of the vocabulary: drafts rejected
    config = parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 3, "model": "x"})
    speculator = Speculator(config, DraftModelProposer(ReferenceEngine(other, max_tokens=4096, block_size=4)))
    expected, _ = run(model, workload(), kv_tokens=160, budget=48)
    found, scheduler = run(model, workload(), speculator, kv_tokens=160, budget=48)
    same_outputs(found, expected)
    assert scheduler.stats.preemptions > 0 and scheduler.stats.spec_accepted_tokens < scheduler.stats.spec_draft_tokens


def test_a_draft_model_in_small_steps_or_a_small_pool_changes_nothing(model):
    """The draft's steps within a GPU engine's limits (8 tokens, 2 sequences: prompts run in parts), and a draft
    pool that holds only some sequences: those get no drafts, and the tokens stay the target's."""
    greedy = [(prompt, replace(params, temperature=0.0)) for prompt, params in workload()]
    expected, _ = run(model, greedy)
    config = parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 3, "model": "x"})
    limited = DraftModelProposer(ReferenceEngine(model, max_tokens=4096, block_size=4), max_tokens=8, max_seqs=2)
    found, scheduler = run(model, greedy, Speculator(config, limited))
    same_outputs(found, expected)
    assert scheduler.stats.spec_accepted_tokens == scheduler.stats.spec_draft_tokens > 0
    small = DraftModelProposer(ReferenceEngine(model, max_tokens=48, block_size=4))
    found, scheduler = run(model, greedy, Speculator(config, small))
    same_outputs(found, expected)
    everyone = run(model, greedy, draft_of(model, 3))[1].stats.spec_drafts
    assert 0 < scheduler.stats.spec_drafts < everyone
    assert not small.seqs and small.engine.allocator.num_free == small.engine.allocator.num_blocks  # all released


def test_a_draft_holding_more_blocks_than_it_needs_frees_none_of_them(model):
    """A draft sequence past what its next drafts need (fewer drafts wanted near a limit) keeps its blocks: they
    are not counted free for the requests after it, which get no drafts rather than a pool overrun."""
    from pegainfer.runtime.speculative import DraftRequest

    proposer = DraftModelProposer(ReferenceEngine(model, max_tokens=24, block_size=4))  # 6 blocks
    (drafts,) = proposer.propose([DraftRequest(0, list(range(1, 7)), 4)])
    assert len(drafts) == 4 and proposer.engine.allocator.num_free == 3
    found = proposer.propose([DraftRequest(0, list(range(1, 7)) + drafts[:1], 1),
                              DraftRequest(1, list(range(20, 35)), 1)])  # 4 blocks wanted, 3 free
    assert found == [drafts[1:2], []]


def test_a_gpu_target_leaves_a_draft_model_its_weights_and_a_kv_share(tiny_checkpoint):
    from pegainfer.cli import build_parser
    from pegainfer.runtime.bench import weight_bytes
    from pegainfer.server.engines import gpu_options

    config = json.dumps({"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny_checkpoint)})
    args = build_parser().parse_args(["serve", "--model-path", str(tiny_checkpoint), "--speculative-config", config])
    target = load_model(tiny_checkpoint, lazy=True, device="cuda")  # as serve loads it for the GPU: bf16
    options = gpu_options(args, target, max_model_len=4096, step_tokens=2048)
    assert options.kv_share == 0.5 and options.verify_tokens == 4  # a draft of the target's own KV size
    assert options.reserved_bytes == weight_bytes(target.spec) + DRAFT_WORKSPACE
    given = build_parser().parse_args(["serve", "--model-path", str(tiny_checkpoint), "--speculative-config", config,
                                       "--kv-cache-tokens", "4096"])
    assert (gpu_options(given, target, 4096, 2048).reserved_bytes, gpu_options(given, target, 4096, 2048).kv_share) \
        == (0, 1.0)  # the draft's pool is then given in tokens too


class FixedDrafts:
    """Proposes the same drafts to every sequence: the rejection sampler's test bench."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, requests):
        return [self.drafts[:r.k] for r in requests]

    def release(self, seq_id: int) -> None:
        pass


def target_probabilities(model, tokens: list[int]) -> np.ndarray:
    engine = ReferenceEngine(model, max_tokens=256)
    logits = engine.step([Chunk(Sequence(0, list(tokens)), len(tokens))])[0].astype(np.float64)
    p = np.exp(logits - logits.max())
    return p / p.sum()


def chi_square_z(counts: Counter, p: np.ndarray, draws: int) -> float:
    """The chi-square statistic of `counts` against `p`, tokens expected fewer than 5 times pooled in one bin, as
    a z-score by Wilson and Hilferty's cube-root approximation (over 3.7: p < 1e-4)."""
    big = [t for t in range(p.size) if p[t] * draws >= 5]
    observed = [counts.get(t, 0) for t in big] + [draws - sum(counts.get(t, 0) for t in big)]
    expected = [p[t] * draws for t in big] + [draws * (1 - sum(p[t] for t in big))]
    pairs = [(o, e) for o, e in zip(observed, expected) if e > 0]
    statistic = sum((o - e) ** 2 / e for o, e in pairs)
    df = len(pairs) - 1
    return ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def test_kept_tokens_follow_the_target_distribution_at_the_first_and_a_later_position(model):
    """Many seeded requests of one prompt; past their first token (drawn at the prompt, no drafts yet) each
    verifies the same two drafts, the target's likeliest tokens after the likeliest first token t0. Where the first
    token is t0, the next is drawn from p(. | prompt, t0); where the first draft was kept too, the one after from
    p(. | prompt, t0, draft). A sampler that kept drafts by the draft's own distribution (always, q being one
    point) fails the same test."""
    prompt, draws = [3, 1, 4, 1, 5], 2000
    t0 = int(np.argmax(target_probabilities(model, prompt)))
    p1 = target_probabilities(model, prompt + [t0])
    d1 = int(np.argmax(p1))
    p2 = target_probabilities(model, prompt + [t0, d1])
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    scheduler = Scheduler(ReferenceEngine(model, max_tokens=draws * 12, block_size=4), frozenset(),
                          SchedulerConfig(max_num_seqs=draws, max_num_batched_tokens=draws * 8, max_model_len=64,
                                          prefix_cache=False),
                          Speculator(config, FixedDrafts([d1, int(np.argmax(p2))])))
    for seed in range(draws):
        scheduler.add(EngineRequest(str(seed), prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=4)))
    outputs = {name: [t.token_id for t in made] for name, made in drain(scheduler).items()}
    first = [tokens[1] for tokens in outputs.values() if tokens[0] == t0]
    later = [tokens[2] for tokens in outputs.values() if tokens[:2] == [t0, d1]]
    assert scheduler.stats.spec_accepted_tokens > 0 and len(first) > 300 and len(later) > 100
    assert chi_square_z(Counter(first), p1, len(first)) < 3.7
    assert chi_square_z(Counter(later), p2, len(later)) < 3.7
    assert chi_square_z(Counter({d1: len(first)}), p1, len(first)) > 3.7  # drafts kept as proposed: caught


def test_ngram_lookup_and_acceptance_count():
    assert ngram_drafts([1, 2, 3, 4, 1, 2, 3], 3, 1, 4) == [4, 1, 2]
    assert ngram_drafts([5, 6, 7], 2, 1, 3) == []
    assert ngram_drafts([1, 1, 1, 1], 2, 1, 2) == [1, 1]
    assert ngram_drafts([9, 4, 9, 5, 9], 2, 2, 2) == []  # no 2-gram recurs; 1-grams are below the minimum
    assert accepted_count([4, 5, 6], [4, 5, 7, 8]) == 2
    assert accepted_count([4, 5], [4, 5, 1]) == 2
    assert accepted_count([4], [3, 9]) == 0


@pytest.mark.parametrize("text, message", [
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be an integer in 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
     "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
    ('{"method": "eagle3", "num_speculative_tokens": 2}', "method eagle3 needs \"model\""),
    ('{"method": "mtp", "num_speculative_tokens": 2, "model": "x"}', "\"model\" is for draft_model and eagle3"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key 'typo'"),
    ('{"method": "ngram", ', "not JSON"),
])
def test_bad_configurations_are_refused_in_one_line(text, message):
    with pytest.raises(ConfigError, match=message) as error:
        parse_speculative_config(text)
    assert "\n" not in str(error.value)


def test_a_draft_of_another_vocabulary_or_with_recurrent_layers_is_refused(model, checkpoint_factory):
    other = str(checkpoint_factory("odd_single_kv"))  # vocabulary 389
    config = parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 2, "model": other})
    with pytest.raises(ConfigError, match="vocabulary of 389 tokens, the target 512"):
        make_speculator(config, model, "cpu", 1024, 4)
    hybrid = str(checkpoint_factory("qwen3_5_hybrid"))
    config = parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 2, "model": hybrid})
    with pytest.raises(ConfigError, match="recurrent layers"):
        make_speculator(config, load_model(hybrid), "cpu", 1024, 4)


def test_a_recurrent_target_needs_a_spare_state_row_a_sequence(checkpoint_factory):
    hybrid = load_model(checkpoint_factory("qwen3_5_hybrid"))
    with pytest.raises(ValueError, match="spare state row for each of max_num_seqs \\(4\\).* the engine has 2"):
        Scheduler(ReferenceEngine(hybrid, max_tokens=256, max_seqs=4, spare_states=2), frozenset(),
                  SchedulerConfig(max_num_seqs=4), make_speculator(NGRAM, hybrid, "cpu", 256, 4))


def test_serve_speculates_with_ngram_and_counts_it_in_metrics(tiny_checkpoint, tmp_path):
    server = start_server(tiny_checkpoint, "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 4}', log=tmp_path / "serve.log")
    try:
        body = {"model": NAME, "prompt": REPEATING, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        answer = server.post("/v1/completions", body)
        assert answer.status_code == 200, answer.text
        metrics = server.metrics()
        drafted, accepted = metrics["vllm:spec_decode_num_draft_tokens"], metrics["vllm:spec_decode_num_accepted_tokens"]
        assert drafted > 0 and accepted / drafted > 0.8
        assert metrics["vllm:generation_tokens_total"] == 40
        assert "speculative decoding: ngram, 4 tokens" in server.log.read_text()
    finally:
        stop_server(server)
    plain = subprocess.run([sys.executable, "-m", "pegainfer.cli", "generate", "--model-path", str(tiny_checkpoint),
                            "--device", "cpu", "--prompt-ids", "36,37,38", "--max-tokens", "40", "--ignore-eos"],
                           capture_output=True, text=True, timeout=120)
    assert plain.stdout.strip() == answer.json()["choices"][0]["text"]


def test_serve_refuses_a_bad_speculative_config_at_start(tiny_checkpoint):
    command = [sys.executable, "-m", "pegainfer.cli", "serve", "--model-path", str(tiny_checkpoint), "--device", "cpu",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 40}']
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("pegainfer: error: --speculative-config: num_speculative")


class OracleDrafts:
    """Drafts that are the known output up to a random point and wrong from there: every acceptance length, from
    none to all, is exercised."""

    def __init__(self, expected: dict[int, list[int]], vocab: int, seed: int = 0) -> None:
        self.expected, self.vocab, self.rng = expected, vocab, np.random.default_rng(seed)

    def propose(self, requests):
        drafts = []
        for r in requests:
            known = self.expected[r.seq_id]
            truth = known[len(r.tokens):len(r.tokens) + r.k]
            wrong = int(self.rng.integers(0, len(truth) + 1))
            drafts.append(truth[:wrong] + [(t + 1) % self.vocab for t in truth[wrong:wrong + 1]] + truth[wrong + 1:])
        return drafts

    def release(self, seq_id: int) -> None:
        pass


@pytest.mark.parametrize("name", ["tiny_tied", "qwen3_5_hybrid"])
def test_partly_accepted_drafts_roll_back_the_cache_and_the_recurrent_state(checkpoint_factory, name):
    """Every acceptance length, on attention only and on a hybrid model whose recurrent state must go back to
    before the drafts: the tokens (greedy and seeded) are those of decoding without drafts."""
    target = load_model(checkpoint_factory(name))
    work = workload()
    recurrent = name.startswith("qwen3_5")

    def serve(speculator):
        scheduler = Scheduler(ReferenceEngine(target, max_tokens=4096, block_size=4, max_seqs=8,
                                              spare_states=8 if recurrent else 0), frozenset(),
                              SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                              speculator)
        for i, (prompt, params) in enumerate(work):
            scheduler.add(EngineRequest(str(i), list(prompt), params))
        made = drain(scheduler)
        return {str(i): [t.token_id for t in made[str(i)]] for i in range(len(work))}, scheduler.stats
    expected, _ = serve(None)
    full = {i: list(prompt) + expected[str(i)] for i, (prompt, _) in enumerate(work)}
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    found, stats = serve(Speculator(config, OracleDrafts(full, target.spec.config.vocab_size)))
    assert found == expected
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert len(stats.spec_accepted_by_position) == 4  # some drafts kept whole, others cut at each position


@pytest.mark.parametrize("extra, step_tokens, samples", [
    ([], 2048, 256),  # a row a sequence without speculation
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'], 2048, 256 * 5),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 8}'], 2048, 2048),  # a step's tokens
])
def test_the_gpu_engine_draws_at_most_a_row_a_token_of_the_step(tiny_checkpoint, extra, step_tokens, samples):
    """The GPU engine's rows of logits a step (sized buffers, taken from the KV budget): a row for each draft and
    the token before it, never more than a step has tokens, never fewer than a row a sequence."""
    from pegainfer.cli import build_parser
    from pegainfer.server.engines import gpu_options

    args = build_parser().parse_args(["serve", "--model-path", str(tiny_checkpoint), "--max-num-seqs", "256", *extra])
    assert gpu_options(args, None, max_model_len=4096, step_tokens=step_tokens).max_samples == samples
