"""Steps padded to the shapes of captured CUDA graphs: decode steps to a bucket of sequences of one token, and
verify steps (decode tokens with their drafts, every token drawn) to a bucket of sequences of K + 1 tokens each.
Padding writes no KV slot and is drawn greedily; the real rows keep their values."""

import numpy as np

from pegainfer.ir.step import (HEAD_ROW_INPUTS, LORA_SLOTS, PENALTY_COUNT, PENALTY_IDS, PENALTY_START, PENALTY_TERMS,
                               SAMPLING_INPUTS, STATE_SLOTS, TOKEN_BITMASK, TOKEN_MASK_INDEX, TOP_LOGPROBS)
from pegainfer.runtime.device_sampling import greedy_inputs

PADDING_BLOCK = 0  # a KV block no sequence owns: padding slots of captured decode steps point here
PADDING_SLOT = 0  # likewise a row of the recurrent state pools, for padding sequences (which start from zeros)


def pad_decode_step(step: dict[str, np.ndarray], bucket: int) -> dict[str, np.ndarray]:
    """Pads a decode step to `bucket` sequences of one token. A padding sequence writes nowhere (slot -1) and
    attends to one token of the padding block, so it can never touch a real sequence's KV; its recurrent state is
    the padding slot's, which it starts from zeros (its context is its one token)."""
    real = len(step["query_lens"])
    extra = bucket - real
    if extra == 0:
        return step
    rows = np.arange(real, bucket, dtype=np.int32)
    tables = np.full((bucket, step["block_tables"].shape[1]), PADDING_BLOCK, dtype=np.int32)
    tables[:real] = step["block_tables"]
    return {
        "input_ids": np.concatenate([step["input_ids"], np.zeros(extra, np.int32)]),
        "positions": np.concatenate([step["positions"], np.zeros(extra, np.int32)]),
        "slot_mapping": np.concatenate([step["slot_mapping"], np.full(extra, -1, np.int32)]),
        "block_tables": tables,
        "seq_starts": np.concatenate([step["seq_starts"], rows]),
        "query_lens": np.concatenate([step["query_lens"], np.ones(extra, np.int32)]),
        "context_lens": np.concatenate([step["context_lens"], np.ones(extra, np.int32)]),
        "logits_indices": np.concatenate([step["logits_indices"], rows]),
        **padded_rows(step, np.arange(real), bucket),
        **({STATE_SLOTS: np.concatenate([step[STATE_SLOTS], np.full(extra, PADDING_SLOT, np.int32)])}
           if STATE_SLOTS in step else {}),
        **({LORA_SLOTS: np.concatenate([step[LORA_SLOTS], np.full(extra, -1, np.int32)])}  # no adapter
           if LORA_SLOTS in step else {}),
        **{name: _spread(step[name], np.arange(real), 0, bucket) for name in HEAD_ROW_INPUTS if name in step},
    }


def verify_rows(query_lens: np.ndarray, width: int) -> np.ndarray:
    """Where each token of a step lands when each of its sequences is padded to `width` tokens."""
    lens = np.asarray(query_lens)
    assert lens.max(initial=1) <= width, f"a sequence of {lens.max()} tokens in a verify step {width} wide"
    dest = np.arange(len(lens))[:, None] * width + np.arange(width)
    return dest[np.arange(width) < lens[:, None]]


def pad_verify_step(step: dict[str, np.ndarray], bucket: int, width: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Pads a step of short sequences (decode tokens and their drafts, a draft head's catch-up), each drawn at every
    token or at its last, to `bucket` sequences of `width` tokens. A sequence's padding tokens follow its own (its
    context grows by them, so causal attention keeps them out of its real tokens' view; the caller sees that it
    stays within the block table), at position 0, and write no KV (slot -1); padding sequences attend to the
    padding block only. Returns the step and, for each of the step's draws, its row in the padded step's (every
    token's) rows. A model with recurrent state only where every sequence has `width` tokens (padding tokens would
    advance its state): padding sequences then run from the padding slot's zeros, as a padded decode step's do. A
    real token's masked scores of the keys past it weigh those keys' values by 0: exact while the KV pool holds
    only finite values (zeroed at allocation, written only with finite ones; FP8 saturates), which padding's
    unwritten slots rely on."""
    lens, real = step["query_lens"], len(step["query_lens"])
    assert STATE_SLOTS not in step or (lens == width).all(), "a recurrent model's sequences cannot take padding tokens"
    tokens, total = verify_rows(lens, width), bucket * width
    draws = tokens[step["logits_indices"]]
    tables = np.full((bucket, step["block_tables"].shape[1]), PADDING_BLOCK, dtype=np.int32)
    tables[:real] = step["block_tables"]
    context = np.full(bucket, width, np.int32)
    context[:real] = step["context_lens"] - lens + width

    padded = {
        "input_ids": _spread(step["input_ids"], tokens, 0, total),
        "positions": _spread(step["positions"], tokens, 0, total),
        "slot_mapping": _spread(step["slot_mapping"], tokens, -1, total),
        "block_tables": tables,
        "seq_starts": np.arange(0, total, width, dtype=np.int32),
        "query_lens": np.full(bucket, width, np.int32),
        "context_lens": context,
        "logits_indices": np.arange(total, dtype=np.int32),
        **padded_rows(step, draws, total),
    }
    if LORA_SLOTS in step:
        padded[LORA_SLOTS] = _spread(step[LORA_SLOTS], tokens, -1, total)
    if STATE_SLOTS in step:
        padded[STATE_SLOTS] = np.concatenate([step[STATE_SLOTS], np.full(bucket - real, PADDING_SLOT, np.int32)])
    padded |= {name: _spread(step[name], tokens, 0, total) for name in HEAD_ROW_INPUTS if name in step}
    return padded, draws


def padded_rows(step: dict[str, np.ndarray], at: np.ndarray, rows: int) -> dict[str, np.ndarray]:
    """The step's inputs of a row of logits each, its rows placed `at` these of `rows`: the rest drawn greedily,
    unmasked and without penalties."""
    greedy = greedy_inputs(1)
    padded = {name: _spread(step[name], at, greedy[name][0], rows) for name in (*SAMPLING_INPUTS, TOP_LOGPROBS)}
    if TOKEN_MASK_INDEX in step:
        padded |= {TOKEN_MASK_INDEX: _spread(step[TOKEN_MASK_INDEX], at, -1, rows), TOKEN_BITMASK: step[TOKEN_BITMASK]}
    if PENALTY_COUNT in step:
        padded |= {PENALTY_START: _spread(step[PENALTY_START], at, 0, rows),
                   PENALTY_COUNT: _spread(step[PENALTY_COUNT], at, 0, rows),
                   PENALTY_IDS: step[PENALTY_IDS], PENALTY_TERMS: step[PENALTY_TERMS]}
    return padded


def _spread(values: np.ndarray, at: np.ndarray, fill, size: int) -> np.ndarray:
    """`size` rows of `fill`, the values' rows placed `at` these."""
    out = np.full((size, *values.shape[1:]), fill, dtype=values.dtype)
    out[at] = values
    return out
