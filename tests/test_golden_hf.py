"""Layer 1 of correctness: the reference executor against Hugging Face transformers (float32, CPU) on random
checkpoints: packed prefill of prompts of different lengths, 16 teacher-forced decode steps through the paged KV
cache, and greedy generation."""

import numpy as np
import pytest
import torch
import transformers

from golden_configs import GOLDEN_CONFIGS
from pegainfer.frontends.load import load_model
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.generate import Request, generate
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.tokenizer import eos_token_ids

PROMPT_LENGTHS = (5, 17, 1, 33)  # crosses 16-token block edges; a one-token prompt
DECODE_STEPS = 16
TOLERANCE = 1e-4


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def make_prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def hf_model(folder):
    """The checkpoint's own class: a multimodal wrapper as itself, not its text-only form."""
    architecture = transformers.AutoConfig.from_pretrained(folder).architectures[0]
    return getattr(transformers, architecture).from_pretrained(folder, attn_implementation="eager",
                                                               dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy continuation by full forwards (no cache): the tokens and the logits that chose each."""
    tokens, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = model(torch.tensor([tokens])).logits[0, -1].numpy()
            logits.append(row)
            tokens.append(int(row.argmax()))
    return tokens[len(prompt):], logits


@pytest.mark.parametrize("lowered", [False, True], ids=["declared", "lowered"])
@pytest.mark.parametrize("name", sorted(GOLDEN_CONFIGS))
def test_prefill_and_decode_match_hf(checkpoint_factory, name, lowered):
    """The graph as declared, and the kernel DAG the pass pipeline makes of it (merged weights derived at load)."""
    folder = checkpoint_factory(name)
    ours = load_model(folder)
    theirs = hf_model(folder)
    prompts = make_prompts(ours.spec.config.vocab_size)
    engine = ReferenceEngine(ours, max_tokens=sum(PROMPT_LENGTHS) + len(PROMPT_LENGTHS) * DECODE_STEPS + 64,
                             graph=lower(ours.spec.graph)[0] if lowered else None)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]

    prefill = engine.step([Chunk(s, len(s.token_ids)) for s in seqs], all_logits=True)
    with torch.no_grad():
        expected = np.concatenate([theirs(torch.tensor([p])).logits[0].numpy() for p in prompts])
    assert prefill.shape == expected.shape
    assert relative_error(prefill, expected) < TOLERANCE

    greedy = [hf_greedy(theirs, p, DECODE_STEPS) for p in prompts]
    last_rows = np.cumsum(PROMPT_LENGTHS) - 1
    step_logits = prefill[last_rows]
    for step in range(DECODE_STEPS):
        expected = np.stack([logits[step] for _, logits in greedy])
        assert relative_error(step_logits, expected) < TOLERANCE, f"decode step {step}"
        assert step_logits.argmax(-1).tolist() == [tokens[step] for tokens, _ in greedy]
        for seq, (tokens, _) in zip(seqs, greedy):
            seq.token_ids.append(tokens[step])
        step_logits = engine.step([Chunk(s, 1) for s in seqs])


@pytest.mark.parametrize("name", sorted(GOLDEN_CONFIGS))
def test_greedy_generation_matches_hf_generate(checkpoint_factory, name):
    folder = checkpoint_factory(name)
    ours = load_model(folder)
    theirs = hf_model(folder)
    prompts = make_prompts(ours.spec.config.vocab_size)
    engine = ReferenceEngine(ours, max_tokens=1024)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS)
    completions = generate(engine, [Request(p, params) for p in prompts], eos_token_ids(folder))
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            out = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=DECODE_STEPS)
        assert completion.token_ids == out[0, len(prompt):].tolist()
    assert engine.allocator.num_free == engine.allocator.num_blocks, "generate must free every KV block"
