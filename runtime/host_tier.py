"""A host-memory tier under the prefix cache (--kv-offload-gb): a full cached block is copied into a pool of host
blocks once no sequence holds it (so that when the device pool evicts it, later, the copy is long done and no step
waits for it), findable by the same hash chain; a later prefix hit past the device's cached blocks takes these,
each copied back into a fresh device block, instead of recomputing them; the sequence is admitted once they have
landed (a GPU copies on a side stream meanwhile), and so is any other whose prefix hit takes one of them. Host
blocks are reused least recently used first. The engines give the copies: the CPU engine's are NumPy copies
between two pools of arrays."""

from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Protocol

from pegainfer.errors import PegainferError
from pegainfer.runtime.kv_blocks import BlockAllocator, BlockTable
from pegainfer.runtime.prefix_cache import PrefixCache, chain_hashes

GIB = 1 << 30


class BlockCopies(Protocol):
    """What an engine offers the tier: its KV bytes a block, a host pool of `host_blocks` blocks, and block copies
    between it and the device pool."""

    def kv_bytes_per_block(self) -> int: ...

    def allocate_host_blocks(self, host_blocks: int) -> None: ...

    def offload_block(self, device_block: int, host_block: int) -> None: ...

    def settle_block(self, device_block: int) -> None:
        """The device block is evicted: the steps from now on, which may write it, follow its copy down."""

    def restore_blocks(self, pairs: list[tuple[int, int]]) -> object:
        """(host block, device block) pairs copied back; returns a handle for restore_done."""

    def restore_done(self, handle: object) -> bool:
        """Whether those copies have landed (a step may read the blocks)."""

    def restore_seconds(self) -> float:
        """Time the copies back have taken so far (on a GPU: those that have finished)."""


class HostTier:
    def __init__(self, engine: BlockCopies, capacity: int, block_size: int) -> None:
        self.engine, self.capacity, self.block_size = engine, capacity, block_size
        engine.allocate_host_blocks(capacity)  # at start: pinning many GiB takes seconds, and may fail
        self._block_of: OrderedDict[bytes, int] = OrderedDict()  # hash -> host block, least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self.offloaded = 0  # blocks copied down
        self.restored = 0  # blocks copied back
        self.restore_seconds = 0.0  # the copies back's time, read from the engine in its thread (lookups, restores)
        self.hits = 0  # prompt tokens found here past the device's own hits
        self.pinned: set[bytes] = set()  # blocks about to be restored: never the ones a copy-down replaces
        self._on_device: OrderedDict[bytes, None] = OrderedDict()  # host blocks the device caches too, LRU first
        self._landing: dict[int, object] = {}  # device block -> the handle of its copy back in flight
        self.holders: list = []  # waiting requests holding blocks while their host blocks come back

    @property
    def used(self) -> int:
        return len(self._block_of)

    def keep(self, block_hash: bytes, device_block: int) -> None:
        """Copies down a cached block no sequence holds any more (the device pool may evict it later)."""
        if block_hash in self._block_of:
            self._block_of.move_to_end(block_hash)
            self._on_device[block_hash] = None
            self._on_device.move_to_end(block_hash)
            return
        if self._free:
            host = self._free.pop()
        else:
            victim = self._victim()
            if victim is None:
                return  # every host block is about to be restored: this one is not kept
            host = self._block_of.pop(victim)
            self._on_device.pop(victim, None)
        self.engine.offload_block(device_block, host)
        self._block_of[block_hash] = host
        self._on_device[block_hash] = None
        self.offloaded += 1

    def _victim(self) -> bytes | None:
        """The host block to reuse: the least recently used of those the device still caches too (copied down as
        they went idle, or copied back, so dropping them loses nothing yet), else the least recently used; never a
        pinned one (in a restore being planned). A copy back still reading the block comes first on the engine's
        copy stream, before the copy down that rewrites it."""
        if self._on_device:  # a subset of the host's blocks, none pinned
            return next(iter(self._on_device))
        return next((h for h in self._block_of if h not in self.pinned), None)

    def settle(self, block_hash: bytes, device_block: int) -> None:
        """The device pool evicts a cached block (kept here since it went idle): it may be written from now on."""
        self._on_device.pop(block_hash, None)
        self._landing.pop(device_block, None)  # a copy back still in flight: the engine orders it before reuse
        self.engine.settle_block(device_block)

    def lookup(self, token_ids: Seq[int], start_block: int, parent: bytes, max_blocks: int) -> list[bytes]:
        """The hashes of the host blocks that continue a prefix hit from block `start_block` (whose parent hash is
        `parent`), at most up to `max_blocks`."""
        self.restore_seconds = self.engine.restore_seconds()  # the GPU's events are read in the engine's thread
        found = []
        for block in range(start_block, min(max_blocks, len(token_ids) // self.block_size)):
            (parent,) = chain_hashes(token_ids, self.block_size, parent, block, block + 1)
            if parent not in self._block_of:
                break
            found.append(parent)
        return found

    def bring_back(self, hashes: list[bytes], cache: PrefixCache, allocator: BlockAllocator,
                   reserved: int) -> list[int]:
        """Fresh device blocks holding the host blocks of `hashes`, cached and held by the caller; the device
        blocks evicted to make room (beyond `reserved`, already promised) were copied down when they went idle."""
        self.pinned.update(hashes)
        short = len(hashes) + reserved - allocator.num_free
        if short > 0:
            cache.evict(short)
        table = BlockTable()
        allocator.grow(table, len(hashes) * self.block_size)
        for block_hash, block in zip(hashes, table.blocks):
            self._block_of.move_to_end(block_hash)
            self._on_device[block_hash] = None
            cache.insert(block, block_hash)
        handle = self.engine.restore_blocks([(self._block_of[h], block) for h, block in zip(hashes, table.blocks)])
        if not self.engine.restore_done(handle):
            self._landing |= dict.fromkeys(table.blocks, handle)
        self.pinned.difference_update(hashes)
        self.restored += len(hashes)
        self.hits += len(hashes) * self.block_size
        self.restore_seconds = self.engine.restore_seconds()
        return table.blocks

    def hold(self, state, blocks: list[int]) -> None:
        """A waiting request holds these cached blocks while its host blocks come back into some of them."""
        state.restoring = blocks
        self.holders.append(state)

    def let_go(self, cache: PrefixCache, states: Iterable | None = None) -> None:
        """The blocks `states` (by default every holder) hold while their host blocks come back, released: they
        stay cached, and `landed` still keeps a request from reading one before its copy is done. For a request
        admitted once they landed, one aborted, or one that cannot fit beside them (a preempted sequence back at
        the head of the queue)."""
        for state in list(self.holders if states is None else states):
            if state.restoring:
                own = cache.release(state.restoring)
                assert not own, f"blocks held while restoring are cached ones, found {own} of its own"
                state.restoring = []
                self.holders.remove(state)

    def landed(self, blocks: Seq[int]) -> bool:
        """Whether every copy back into these device blocks has finished."""
        if not self._landing:
            return True
        pending = {id(h): h for h in map(self._landing.get, blocks) if h is not None}
        done = {key for key, handle in pending.items() if self.engine.restore_done(handle)}
        if done:
            self._landing = {b: h for b, h in self._landing.items() if id(h) not in done}
        return len(done) == len(pending)


def host_capacity(gib: float, bytes_per_block: int, available: int | None = None) -> int:
    """Host blocks that --kv-offload-gb buys; refused where the host has not that much memory free."""
    available = available_host_bytes() if available is None else available
    wanted = int(gib * GIB)
    if wanted > available:
        raise PegainferError(f"--kv-offload-gb {gib:g} asks for {wanted / GIB:.1f} GiB of host memory; "
                             f"{available / GIB:.1f} GiB is available")
    return wanted // bytes_per_block


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be had without swapping)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise PegainferError("cannot read the host's available memory (/proc/meminfo has no MemAvailable)")
