"""The device memory pool: one allocation per lifetime class (weights, activations, KV cache) carved into
256-byte-aligned pieces, so the engine makes a handful of cuMemAlloc calls and its footprint is known up front
(which is what sizing the KV cache from --gpu-memory-utilization needs)."""

from pegainfer.errors import PegainferError
from pegainfer.runtime.cuda import driver

ALIGN = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    def __init__(self, nbytes: int, what: str) -> None:
        self.what, self.size, self.used = what, max(aligned(nbytes), ALIGN), 0
        self.base = driver.alloc(self.size)

    def take(self, nbytes: int) -> int:
        """The device address of `nbytes` fresh bytes (aligned); the arena never frees one piece alone."""
        size = aligned(max(nbytes, 1))
        if self.used + size > self.size:
            raise PegainferError(f"{self.what} pool: {nbytes} bytes asked with {self.size - self.used} of "
                                 f"{self.size} left")
        address = self.base + self.used
        self.used += size
        return address


def kv_blocks_for_memory(utilization: float, bytes_per_block: int, free: int, total: int) -> int:
    """KV blocks that fit once this process holds at most `utilization` of the device's memory (vLLM's meaning of
    --gpu-memory-utilization: weights, activations and the KV cache together), given what is free now."""
    if not 0 < utilization <= 1:
        raise PegainferError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    budget = free - (1 - utilization) * total
    blocks = int(budget // bytes_per_block)
    if blocks < 2:
        used = (total - free) / 1e9
        raise PegainferError(f"--gpu-memory-utilization {utilization} leaves no room for the KV cache: "
                             f"{used:.2f} GB of the device's {total / 1e9:.2f} GB are in use after weights and "
                             f"activations, and one KV block takes {bytes_per_block / 1e6:.2f} MB")
    return blocks
