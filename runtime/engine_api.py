"""What the scheduler asks of an engine (runtime/scheduler.py): the reference engine on the CPU, the GPU engine,
and the sharded engine that drives ranks of either."""

from typing import Callable, Protocol

import numpy as np

from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.constraint import TokenConstraint
from pegainfer.runtime.device_sampling import SampleResult
from pegainfer.runtime.kv_blocks import BlockAllocator
from pegainfer.runtime.sampler import SamplingParams


class Engine(Protocol):
    """What both engines (reference_engine.ReferenceEngine, gpu.engine.GpuEngine) offer the scheduler."""
    allocator: BlockAllocator

    def sample(self, chunks: list[Chunk], params: list[SamplingParams], token_index: list[int],
               constraints: list[TokenConstraint | None] | None = None,
               launched: Callable[[], None] | None = None) -> SampleResult: ...

    def release(self, seq: Sequence) -> None: ...

    # Where an engine also has `launch(chunks, params, token_index, constraints, before_masks=...) ->
    # Callable[[], SampleResult]` and `overlaps` (both engines; not a sharded GPU engine), the scheduler may launch a
    # step before it reads the one before (runtime/overlap.py); `before_masks()` is called between the step's layers
    # and its sampler tail, before its grammar masks and penalties are filled.

    def step(self, chunks: list[Chunk], *, all_logits: bool = False) -> np.ndarray: ...

    def copy_state(self, src: int, dst: int) -> None:
        """Copies row `src` of every recurrent state pool to row `dst`, in order with the steps."""

