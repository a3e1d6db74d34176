"""After a step, what the prefix cache learns of a sequence: its blocks filled since its last step, under their
hash chain, and for a model with recurrent layers its state snapshotted where the step ended on the boundary of its
newest cached block (runtime/state_snapshots.py): copied as the step is read (plain steps), or at its launch and
named as it is read (async scheduling)."""

from pegainfer.runtime.prefix_cache import PrefixCache, chain_hashes
from pegainfer.runtime.state_snapshots import StateSnapshots


def record_blocks(state, cache: PrefixCache | None, snapshots: StateSnapshots | None, engine,
                  copy: bool = True) -> None:
    """`state`: the scheduler's record of a running sequence (its seq, block_hashes, generated_snapshot and
    unnamed_snapshots). `copy`: the state is as the step left it (nothing launched since), copy it now; else the
    rows snapshot_at_launch copied are named, those whose blocks are now hashed."""
    size = cache.block_size if cache is not None else 0
    if cache is None or state.seq.num_cached // size <= len(state.block_hashes):
        return
    _cache_full_blocks(state, cache, size)
    if copy:
        _snapshot(state, snapshots, engine, size)
    elif snapshots is not None:
        _name_snapshots(state, snapshots, size)


def snapshot_at_launch(state, snapshots: StateSnapshots | None, engine, size: int) -> None:
    """A step just launched that ends the sequence on a block boundary not hashed yet: its state copied into a
    reserved row before a later step moves it on (record_blocks names it once the step is read)."""
    seq = state.seq
    if snapshots is None or seq.num_cached % size or seq.num_cached <= len(state.block_hashes) * size:
        return
    row = snapshots.reserve()
    if row is not None:
        engine.copy_state(seq.table.state_slot, row)
        state.unnamed_snapshots.append((seq.num_cached, row))


def _cache_full_blocks(state, cache: PrefixCache, size: int) -> None:
    seq, known = state.seq, len(state.block_hashes)
    full = seq.num_cached // size
    parent = state.block_hashes[-1] if known else state.root
    new = chain_hashes(seq.token_ids, size, parent, known, full)
    for block, block_hash in zip(seq.table.blocks[known:full], new):
        cache.insert(block, block_hash)
    state.block_hashes += new


def _snapshot(state, snapshots: StateSnapshots | None, engine, size: int) -> None:
    seq, block_hash = state.seq, state.block_hashes[-1]
    if snapshots is None or seq.num_cached != len(state.block_hashes) * size or block_hash in snapshots:
        return
    _supersede(state, snapshots, seq.num_cached)
    row = snapshots.reserve()
    if row is not None:
        engine.copy_state(seq.table.state_slot, row)
        _keep(state, snapshots, row, block_hash, seq.num_cached)


def _name_snapshots(state, snapshots: StateSnapshots, size: int) -> None:
    hashed = len(state.block_hashes) * size
    while state.unnamed_snapshots and state.unnamed_snapshots[0][0] <= hashed:
        boundary, row = state.unnamed_snapshots.pop(0)
        block_hash = state.block_hashes[boundary // size - 1]
        if block_hash in snapshots:  # another sequence of the same prefix snapshotted it first
            snapshots.release(row)
            continue
        _supersede(state, snapshots, boundary)
        _keep(state, snapshots, row, block_hash, boundary)


def _supersede(state, snapshots: StateSnapshots, boundary: int) -> None:
    """Past the prompt only the latest boundary of each sequence is kept (a decode makes one a block)."""
    if boundary > len(state.request.prompt_ids) and state.generated_snapshot is not None:
        snapshots.drop(state.generated_snapshot)
        state.generated_snapshot = None


def _keep(state, snapshots: StateSnapshots, row: int, block_hash: bytes, boundary: int) -> None:
    snapshots.name(row, block_hash)
    if boundary > len(state.request.prompt_ids):
        state.generated_snapshot = block_hash
