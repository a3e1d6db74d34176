"""Random small models built straight from a DAG file's Config (no transformers): random configs, float32
weights, and a two-step workload (a packed prefill, then decode tokens beside a prompt chunk)."""

import dataclasses

import numpy as np

from pegainfer.ir.graph import Graph
from pegainfer.ir.interpreter import run_graph
from pegainfer.models import qwen3
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step
from pegainfer.runtime.kv_blocks import BlockAllocator

BLOCK_SIZE = 4


def random_qwen3_config(rng: np.random.Generator) -> qwen3.Config:
    kv_heads = int(rng.integers(1, 4))
    heads = kv_heads * int(rng.integers(1, 4))
    return qwen3.Config(
        vocab_size=int(rng.integers(20, 90)), hidden_size=int(rng.integers(2, 9)) * 4,
        intermediate_size=int(rng.integers(5, 40)), num_hidden_layers=int(rng.integers(1, 4)),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=int(rng.choice([2, 4, 6, 8, 16])),
        rms_norm_eps=float(rng.choice([1e-6, 1e-5])), rope_theta=float(rng.choice([100.0, 1e4, 1e6])),
        attention_bias=bool(rng.integers(2)), tie_word_embeddings=bool(rng.integers(2)), torch_dtype="float32")


def random_weights(graph: Graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {name: (rng.standard_normal(t.shape) * 0.5).astype(np.float32)
            for name, t in graph.checkpoint_params().items()}


def run_workload(graph: Graph, weights: dict[str, np.ndarray], vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """Every output of two steps over fresh KV states: prompts of 5, 1 and 9 tokens (the last in two chunks),
    then one decode token each for the first two and the second chunk of the third."""
    rng = np.random.default_rng(seed)
    allocator = BlockAllocator(num_blocks=32, block_size=BLOCK_SIZE)
    sizes = {"num_blocks": 32, "block_size": BLOCK_SIZE}
    states = {name: np.zeros(t.concrete(sizes), t.dtype.np_dtype) for name, t in graph.expanded_states().items()}
    seqs = [Sequence(i, rng.integers(0, vocab_size, n).tolist()) for i, n in enumerate((5, 1, 9))]
    outputs = []
    for plan in ([5, 1, 6], [1, 1, 3]):
        chunks = [Chunk(seq, n) for seq, n in zip(seqs, plan)]
        outputs += run_graph(graph, pack_step(chunks, allocator, all_logits=True), weights, states)
        commit_step(chunks)
        for seq in seqs[:2]:
            seq.token_ids.append(int(rng.integers(0, vocab_size)))
    return outputs


def with_layers(config: qwen3.Config, layers: int) -> qwen3.Config:
    return dataclasses.replace(config, num_hidden_layers=layers)
