"""Prefix caching over the paged KV pool: a full block of tokens whose KV has been written is kept, keyed by a hash
chain of its tokens (the block's tokens and everything before them), so that a later sequence that starts with the
same tokens takes the block instead of computing it again.

A cached block is shared: it counts the sequences holding it. When the last one lets go it is not freed but becomes
evictable, least recently used first, and goes back to the allocator only when the pool runs short. Only full
blocks are shared, and a sequence writes only past its last full block, so a shared block is never written again.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence as Seq

import numpy as np

from pegainfer.runtime.kv_blocks import BlockAllocator, BlockTable

ROOT = b""  # the hash before a sequence's first block


def root_for(adapter: str | None, salt: str | None = None) -> bytes:
    """The hash before a sequence's first block: the base model's, or one loaded LoRA adapter's own (its KV
    differs; `adapter` is LoraSlots.cache_key, new at each load, so a name loaded again never hits the old KV);
    with a request's cache_salt, one only requests with the same salt share (vLLM's: no prompt guessed from
    another user's hits)."""
    if adapter is None and salt is None:
        return ROOT
    root = ROOT if adapter is None else hashlib.sha256(b"lora\0" + adapter.encode()).digest()
    return root if salt is None else hashlib.sha256(root + b"salt\0" + salt.encode()).digest()


def chain_hashes(token_ids: Seq[int], block_size: int, parent: bytes = ROOT, start_block: int = 0,
                 end_block: int | None = None) -> list[bytes]:
    """The hashes of full blocks start_block .. end_block-1, each over its tokens and its parent's hash. sha256, not
    Python's hash: a collision would hand a sequence another prompt's KV."""
    end_block = len(token_ids) // block_size if end_block is None else end_block
    hashes = []
    for block in range(start_block, end_block):
        tokens = np.asarray(token_ids[block * block_size:(block + 1) * block_size], dtype=np.int64)
        parent = hashlib.sha256(parent + tokens.tobytes()).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, on_evict: Callable[[bytes, int], None] | None = None,
                 on_idle: Callable[[bytes, int], None] | None = None) -> None:
        """`on_evict(hash, block)`: told of each block evicted before it goes back to the allocator (what is kept
        beside a block goes with it); `on_idle(hash, block)`: of each block no sequence holds any more (a host tier
        copies it down then)."""
        self.allocator, self.on_evict, self.on_idle = allocator, on_evict, on_idle
        self.block_size = allocator.block_size
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refs 0, least recently used first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, tokens found
        self.evictions = 0  # blocks

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def lookup(self, token_ids: Seq[int], max_blocks: int, root: bytes = ROOT) -> tuple[list[int], list[bytes]]:
        """The longest run of cached blocks that starts the sequence (its chain from `root`), at most
        `max_blocks`: (blocks, hashes). Takes nothing: `acquire` does, once the caller has decided to use them."""
        blocks, hashes, parent = [], [], root
        for block in range(min(max_blocks, len(token_ids) // self.block_size)):
            (parent,) = chain_hashes(token_ids, self.block_size, parent, block, block + 1)
            found = self._block_of.get(parent)
            if found is None:
                break
            blocks.append(found)
            hashes.append(parent)
        return blocks, hashes

    def count_evictable(self, blocks: list[int]) -> int:
        """How many of `blocks` acquiring them would take out of the evictable pool."""
        return sum(1 for b in blocks if b in self._evictable)

    def acquire(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] += 1
            self._evictable.pop(block, None)

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit

    def insert(self, block: int, block_hash: bytes) -> None:
        """Registers a sequence's block that has just become full and computed; the sequence holds it. A block
        whose tokens are cached already (two equal prompts prefilled together) stays the sequence's own."""
        if block_hash in self._block_of or block in self._hash_of:
            return
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self._refs[block] = 1

    def release(self, blocks: list[int]) -> list[int]:
        """A sequence lets go of its blocks: cached ones lose a reference (last block first into the LRU order, so
        the tail of a prompt is evicted before its head); returns the blocks that were its own, to be freed."""
        own = []
        for block in reversed(blocks):
            if block in self._hash_of:
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._evictable[block] = None
                    if self.on_idle is not None:
                        self.on_idle(self._hash_of[block], block)
            else:
                own.append(block)
        return own[::-1]

    def evict(self, count: int) -> int:
        """Frees up to `count` least recently used unreferenced blocks to the allocator; returns how many."""
        freed = []
        while self._evictable and len(freed) < count:
            block, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of.pop(block)
            del self._block_of[block_hash], self._refs[block]
            if self.on_evict is not None:
                self.on_evict(block_hash, block)
            freed.append(block)
        count = len(freed)
        self.evictions += count
        self.allocator.release(BlockTable(freed))  # empties `freed`
        return count

    def clear(self) -> None:
        """Frees every unreferenced block (blocks still held stay cached)."""
        self.evict(len(self._evictable))
