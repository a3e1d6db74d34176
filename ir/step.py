"""The step interface every model graph shares with the runtime: the names and types of one step's inputs.

A step is a packed batch of sequences (prefill chunks and decode tokens alike; see ir/ops/attention.py for the
layout). The runtime fills these inputs by name, so a DAG file declares them through this module, never by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pegainfer.ir.dtypes import FP32, INT32, INT64
from pegainfer.ir.graph import Graph
from pegainfer.ir.types import TensorType

if TYPE_CHECKING:  # the builder's module verifies graphs, and the verifier reads STEP_INPUTS from here
    from pegainfer.ir.builder import GraphBuilder, Value

TOKEN_INPUTS = ("input_ids", "positions", "slot_mapping")
SEQUENCE_INPUTS = ("seq_starts", "query_lens", "context_lens")
LOGITS_INDICES = "logits_indices"
BLOCK_TABLES = "block_tables"
# Layers with a recurrent state (linear attention) keep one fixed-size row per running sequence in pools of
# SLOT_POOL rows; STATE_SLOTS [batch] says which row each sequence of the step owns (runtime/kv_blocks.py).
STATE_SLOTS, SLOT_POOL = "state_slots", "num_state_slots"
LORA_SLOTS = "lora_slots"  # [tokens]: each token's adapter slot of the LoRA tables (-1: the base model)
EMBED_GATE = "embed_gate"  # a drafter head's input: 1.0 a token, 0.0 at position 0 (whose embedding it drops)
FEATURES_INPUT = "features"  # a drafter head's input: a row of hidden state a token (the target's, or its own)
HEAD_ROW_INPUTS = (FEATURES_INPUT, EMBED_GATE)  # a drafter head's inputs of a row a token, beside the step's


@dataclass(frozen=True)
class AttentionInputs:
    """What each attention layer needs to read and write its slice of the paged KV cache."""
    positions: Value
    slot_mapping: Value
    block_tables: Value
    seq_starts: Value
    query_lens: Value
    context_lens: Value
    state_slots: Value | None = None  # for models with recurrent layers: each sequence's row of the state pools

    def as_list(self) -> list[Value]:
        return [self.positions, self.slot_mapping, self.block_tables, self.seq_starts, self.query_lens,
                self.context_lens, *([self.state_slots] if self.state_slots is not None else [])]


def declare_attention_inputs(b: GraphBuilder, recurrent: bool = False) -> AttentionInputs:
    """The step's sequence inputs; `recurrent` adds STATE_SLOTS, for a model with recurrent-state layers."""
    return AttentionInputs(
        positions=b.input("positions", INT32, ("tokens",)),
        slot_mapping=b.input("slot_mapping", INT32, ("tokens",)),
        block_tables=b.input(BLOCK_TABLES, INT32, ("batch", "max_blocks")),
        seq_starts=b.input("seq_starts", INT32, ("batch",)),
        query_lens=b.input("query_lens", INT32, ("batch",)),
        context_lens=b.input("context_lens", INT32, ("batch",)),
        state_slots=b.input(STATE_SLOTS, INT32, ("batch",)) if recurrent else None,
    )


def declare_step_inputs(b: GraphBuilder, recurrent: bool = False) -> tuple[Value, AttentionInputs, Value]:
    """(input_ids [tokens], attention inputs, logits_indices [samples]): the rows whose logits the step returns."""
    input_ids = b.input("input_ids", INT32, ("tokens",))
    attention = declare_attention_inputs(b, recurrent)
    logits_indices = b.input(LOGITS_INDICES, INT32, ("samples",))
    return input_ids, attention, logits_indices


def launch_sizes(query_lens) -> dict[str, int]:
    """The sizes kernels' grids use beyond the inputs' shapes: the longest query of the step (0 when empty), and
    how many of its first sequences bring one query each (decode tokens, which the scheduler packs first) and how
    many come after them, so that a mixed step's attention can run the two kinds on different tiles."""
    lens = np.asarray(query_lens)
    decode = int(np.argmin(lens == 1)) if (lens != 1).any() else len(lens)
    return {"max_query_len": int(lens.max(initial=0)), "decode_seqs": decode, "prefill_seqs": len(lens) - decode}


def kv_cache_shape(kv_heads: int, head_dim: int) -> tuple[str, str, int, int]:
    return ("num_blocks", "block_size", kv_heads, head_dim)


def recurrent_state_shape(*dims: int) -> tuple[str, ...]:
    """A recurrent layer's state pool: one row of `dims` per state slot."""
    return (SLOT_POOL, *dims)


def has_recurrent_state(graph: Graph) -> bool:
    """Whether the model keeps per-sequence state rows (then the runtime hands out state slots)."""
    return STATE_SLOTS in graph.inputs


# Per-row sampling parameters, one entry per row of logits (`samples`), which the sampler tail (passes/fusion.py's
# plan_sampler_tail) reads. A step that only wants logits passes greedy rows (runtime/device_sampling.greedy_inputs).
SAMPLING_INPUTS: dict[str, TensorType] = {
    "sampling_temperature": TensorType(FP32, ("samples",)),  # under ir.ops.sampling.GREEDY_BELOW: greedy
    "sampling_top_k": TensorType(INT32, ("samples",)),  # 0 or -1: every token
    "sampling_top_p": TensorType(FP32, ("samples",)),  # 1: no cut
    "sampling_min_p": TensorType(FP32, ("samples",)),
    "sampling_seed": TensorType(INT64, ("samples",)),  # the request's seed (mod 2**64): the Philox key
    "sampling_step": TensorType(INT32, ("samples",)),  # the index of the token being drawn within its request
}
# How many top logprobs a row asks (0: none). The tail ranks a row's top-k candidates only where it asks or its draw
# is cut (top-k, top-p, min-p); another row's top_values and top_ids hold just its largest (ir/ops/basic.py's top_k).
TOP_LOGPROBS = "sampling_top_logprobs"
# The grammar masks a step's rows of logits are drawn under (structured outputs): `masks` bitmask rows of the
# vocabulary's bits, `mask_words` words each (ir/ops/sampling.py's mask_tokens), and per row of logits the bitmask
# row it takes, or -1. A step without masks passes one word of zeros and -1s (runtime/batch.py's pack_step).
TOKEN_BITMASK, TOKEN_MASK_INDEX = "token_bitmask", "token_mask_index"


def mask_input_types(rows: str) -> dict[str, TensorType]:
    return {TOKEN_BITMASK: TensorType(INT32, ("masks", "mask_words")), TOKEN_MASK_INDEX: TensorType(INT32, (rows,))}


def mask_words(vocab: int) -> int:
    return -(-vocab // 32)


# The penalties a step's rows are drawn under (ir/ops/penalties.py, as sparse per-id terms: ir/ops/sampling.py's
# penalize_tokens): per row of logits the first of its entries and how many, and per entry, its token id (ascending
# within a row) and terms (bias, repetition factor, subtrahend). A step without penalties passes counts of 0.
PENALTY_START, PENALTY_COUNT, PENALTY_IDS, PENALTY_TERMS = ("penalty_start", "penalty_count", "penalty_ids",
                                                            "penalty_terms")
PENALTY_ENTRIES = 65536  # a step's penalty entries at least (1 MB of ids and terms); rows past them: on the host
PENALTY_ENTRIES_PER_ROW = 2048  # and as many a row of logits: a repetition penalty counts its prompt's ids


def penalty_capacity(rows: int) -> int:
    """The penalty entries a step of `rows` rows of logits holds on the device."""
    return max(PENALTY_ENTRIES, PENALTY_ENTRIES_PER_ROW * rows)


def penalty_input_types(rows: str) -> dict[str, TensorType]:
    return {PENALTY_START: TensorType(INT32, (rows,)), PENALTY_COUNT: TensorType(INT32, (rows,)),
            PENALTY_IDS: TensorType(INT32, ("penalties",)), PENALTY_TERMS: TensorType(FP32, ("penalties", 3))}


# Every input the runtime uploads for a step, in one copy before the step's first kernel.
STEP_INPUTS = (*TOKEN_INPUTS, *SEQUENCE_INPUTS, BLOCK_TABLES, STATE_SLOTS, LORA_SLOTS, LOGITS_INDICES,
               *SAMPLING_INPUTS, TOP_LOGPROBS, TOKEN_BITMASK, TOKEN_MASK_INDEX, PENALTY_START, PENALTY_COUNT,
               PENALTY_IDS, PENALTY_TERMS)


def uploaded(graph: Graph, value: str) -> bool:
    """Whether `value` is a step input of `graph` (the model's, or a repeated body's, which the verifier holds to
    the model's input of the same name): uploaded before the step's first kernel and written by none, so that a
    kernel may read it before waiting for its predecessor (programmatic dependent launch)."""
    return value in STEP_INPUTS and value in graph.inputs


# What the sampler tail appends to a model graph's outputs, last (after the logits and any other output, such as a
# drafter's features), in this order.
SAMPLER_OUTPUTS = ("top_values", "top_ids", "logsumexp", "sampled_ids", "sampled_logprobs")


def sampler_outputs(graph: Graph) -> dict[str, str] | None:
    """SAMPLER_OUTPUTS role -> the graph's output name, for a graph that has the sampler tail; else None."""
    if not all(name in graph.inputs for name in SAMPLING_INPUTS) or len(graph.outputs) < 1 + len(SAMPLER_OUTPUTS):
        return None
    return dict(zip(SAMPLER_OUTPUTS, graph.outputs[-len(SAMPLER_OUTPUTS):]))
