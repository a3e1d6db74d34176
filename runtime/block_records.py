"""After a step, what the prefix cache learns of a sequence: its blocks filled since its last step, under their
hash chain, and for a model with recurrent layers its state snapshotted where the step ended on the boundary of its
newest cached block (runtime/state_snapshots.py)."""

from pegainfer.runtime.prefix_cache import PrefixCache, chain_hashes
from pegainfer.runtime.state_snapshots import StateSnapshots


def record_blocks(state, cache: PrefixCache | None, snapshots: StateSnapshots | None, engine) -> None:
    """`state`: the scheduler's record of a running sequence (its seq, block_hashes and generated_snapshot)."""
    size = cache.block_size if cache is not None else 0
    if cache is None or state.seq.num_cached // size <= len(state.block_hashes):
        return
    _cache_full_blocks(state, cache, size)
    _snapshot(state, snapshots, engine, size)


def _cache_full_blocks(state, cache: PrefixCache, size: int) -> None:
    seq, known = state.seq, len(state.block_hashes)
    full = seq.num_cached // size
    parent = state.block_hashes[-1] if known else state.root
    new = chain_hashes(seq.token_ids, size, parent, known, full)
    for block, block_hash in zip(seq.table.blocks[known:full], new):
        cache.insert(block, block_hash)
    state.block_hashes += new


def _snapshot(state, snapshots: StateSnapshots | None, engine, size: int) -> None:
    """Past the prompt only the latest boundary of each sequence is kept (a decode makes one a block)."""
    seq, block_hash = state.seq, state.block_hashes[-1]
    if snapshots is None or seq.num_cached != len(state.block_hashes) * size or block_hash in snapshots:
        return
    if seq.num_cached > len(state.request.prompt_ids):
        if state.generated_snapshot is not None:
            snapshots.drop(state.generated_snapshot)
        state.generated_snapshot = block_hash
    engine.copy_state(seq.table.state_slot, snapshots.take(block_hash))
