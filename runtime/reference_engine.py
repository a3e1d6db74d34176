"""The CPU engine: runs steps of a model graph through the reference interpreter over a paged KV cache.
It is the oracle for the GPU runtime and the `--device cpu` path of generate and serve."""

import time
from collections.abc import Callable, Collection

import numpy as np

from pegainfer.frontends.checkpoint import derive_weights
from pegainfer.frontends.features import FEATURES
from pegainfer.frontends.load import LoadedModel
from pegainfer.ir.graph import Graph
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.step import (LORA_SLOTS, PENALTY_START, SLOT_POOL, has_recurrent_state, penalty_capacity,
                               sampler_outputs)
from pegainfer.passes.fusion import TAIL_TOP_K
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step, release_sequence
from pegainfer.runtime.constraint import TokenConstraint
from pegainfer.runtime.device_sampling import (SampleResult, device_masks, finish, mask_inputs, masked_logits,
                                               penalty_inputs, sampling_inputs, tail_reference)
from pegainfer.runtime.kv_blocks import BlockAllocator
from pegainfer.runtime.pending_tokens import pending_rows
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import SchedulerConfig

DEFAULT_BLOCK_SIZE = 16


class ReferenceEngine:
    overlaps = True  # the scheduler may launch a step before it reads the last one (runtime/overlap.py)

    def __init__(self, model: LoadedModel, *, max_tokens: int = 8192, block_size: int = DEFAULT_BLOCK_SIZE,
                 graph: Graph | None = None, max_seqs: int = SchedulerConfig.max_num_seqs,
                 state_snapshots: int | None = None, spare_states: int = 0) -> None:
        """Sizes the KV pool to hold `max_tokens` tokens over all sequences, and for a model with recurrent layers
        the state pools to hold `max_seqs` sequences and `state_snapshots` snapshots for the prefix cache (None:
        as many as sequences) and `spare_states` rows to roll speculating sequences back to. `graph` (the model's
        own graph by default) may be a lowered one: its derived weights are made from the checkpoint's."""
        self.model = model
        self.graph = graph or model.spec.graph
        self.weights = derive_weights(self.graph.derivations(), model.weights)
        slots = max_seqs if has_recurrent_state(self.graph) else 0
        self.allocator = BlockAllocator(-(-max_tokens // block_size), block_size, state_slots=slots,
                                        snapshot_slots=max_seqs if state_snapshots is None else state_snapshots,
                                        spare_slots=spare_states)
        sizes = {"num_blocks": self.allocator.num_blocks, "block_size": block_size,
                 SLOT_POOL: self.allocator.state_rows}
        self.rng = np.random.default_rng()  # seeds for requests that have none
        self.vocab_size = self.graph.value_types()[self.graph.outputs[0]].shape[-1]  # the logits' width
        states = self.graph.expanded_states()
        self.states = {name: np.zeros(t.concrete(sizes), dtype=t.dtype.np_dtype) for name, t in states.items()}
        self.pooled = [name for name, t in states.items() if t.shape[0] == SLOT_POOL]  # copy_state's
        self.drawn: tuple[dict[int, int], list[int]] = ({}, [])  # the last launch's draws: seq_id -> row, tokens
        self.launches = 0
        self.penalties_in_tail = PENALTY_START in self.graph.inputs  # a lowered graph's tail applies them

    def step(self, chunks: list[Chunk], *, all_logits: bool = False) -> np.ndarray:
        """Runs one packed step and returns float32 logits, one row per chunk (or per token with all_logits)."""
        inputs = pack_step(chunks, self.allocator, all_logits=all_logits, lora=self.lora)
        logits = self.execute(inputs)[0]  # a lowered graph adds sampler outputs
        commit_step(chunks)
        return logits.astype(np.float32)

    def sample(self, chunks: list[Chunk], params: list[SamplingParams], token_index: list[int],
               constraints: list[TokenConstraint | None] | None = None,
               launched: Callable[[], None] | None = None) -> SampleResult:
        """Runs one step and draws one token per chunk as the GPU does (the `sample` op, same seeds, same
        tokens); `token_index[i]`: which generated token of its request chunk i's row draws (0 for the first);
        `constraints[i]`: the row's, if any (runtime/constraint.py); `launched`: called once the step's inputs
        are packed, before it runs (as the GPU engine calls it before waiting for the device)."""
        return self.launch(chunks, params, token_index, constraints, launched)()

    def launch(self, chunks: list[Chunk], params: list[SamplingParams], token_index: list[int],
               constraints: list[TokenConstraint | None] | None = None,
               launched: Callable[[], None] | None = None,
               before_masks: Callable[[], Collection[int]] | None = None) -> Callable[[], SampleResult]:
        """`sample`, its result handed back through a call as the GPU engine's launch does: the step has run by then,
        but a row drawn on the host from its logits and read after a later launch is `stale` (the GPU's logits are
        overwritten by then). A PENDING token (runtime/pending_tokens.py) is the one the last launch's tail drew.
        `before_masks()`, with constraints: called before the masks are filled; the rows it gives draw without their
        constraints. A lowered graph draws penalties in its tail, as the GPU's does."""
        self.launches += 1  # before the read inside it: that step's logits count as gone
        launch, sampling = self.launches, sampling_inputs(params, token_index, self.rng)
        inputs = pack_step(chunks, self.allocator, lora=self.lora) | sampling
        for row, draw in pending_rows(chunks, inputs["seq_starts"], self.drawn[0]):
            inputs["input_ids"][row] = self.drawn[1][draw]
        if constraints is not None and any(c is not None for c in constraints) and before_masks is not None:
            dead = set(before_masks())  # once the step is packed, as the GPU engine calls it
            constraints = [None if row in dead else c for row, c in enumerate(constraints)]
        masks = device_masks(constraints, self.vocab_size)
        penalties, penalized = penalty_inputs(constraints, params, len(params), penalty_capacity(len(params))) \
            if constraints and PENALTY_START in self.graph.inputs else ({}, set())
        inputs |= mask_inputs(len(params), masks) | (penalties if penalized else {})
        if launched is not None:
            launched()
        outputs = dict(zip(self.graph.outputs, self.execute(inputs)))
        commit_step(chunks)
        logits = outputs[self.graph.outputs[0]].astype(np.float32)
        names = sampler_outputs(self.graph)  # a lowered graph samples itself (under the masks)
        tail = {role: outputs[name] for role, name in names.items()} if names else \
            tail_reference(masked_logits(logits, masks), sampling, TAIL_TOP_K)
        rows = range(len(chunks)) if len(params) == len(chunks) else range(0)  # one draw a chunk: rows as chunks
        self.drawn = ({chunks[r].seq.seq_id: r for r in rows}, [int(t) for t in tail["sampled_ids"]])

        def result() -> SampleResult:
            assert self.launches - launch <= 1, "a step is read before a second launch after it"
            drawn = finish(tail, sampling, params, lambda row: logits[row], constraints, masks, penalized,
                           logits_gone=self.launches != launch)
            drawn.features = outputs.get(FEATURES)
            return drawn
        return result

    def execute(self, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The graph's outputs for one packed step, its KV and recurrent states updated in place."""
        return run_graph(self.graph, inputs, self.weights, self.states)

    @property
    def lora(self) -> bool:
        """Whether the graph has LoRA tables (frontends/lora.py), whose slots each step's tokens name."""
        return LORA_SLOTS in self.graph.inputs

    def write_lora(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        """An adapter's rows (frontends/lora.adapter_rows) into one slot of every LoRA table."""
        for name, row in rows.items():
            self.states[name][slot] = row

    def kv_bytes_per_block(self) -> int:
        return sum(a[0].nbytes for a in self._kv_pools().values())

    def allocate_host_blocks(self, host_blocks: int) -> None:
        """The host tier's pool (NumPy here too: the tier's logic, not its speed)."""
        self.restore_time = 0.0
        self.host_states = {name: np.zeros((host_blocks, *a.shape[1:]), a.dtype)
                            for name, a in self._kv_pools().items()}

    def offload_block(self, device_block: int, host_block: int) -> None:
        """A block of every layer's KV cache into the host pool."""
        for name, pool in self._kv_pools().items():
            self.host_states[name][host_block] = pool[device_block]

    def settle_block(self, device_block: int) -> None:
        """Nothing to wait for: the copy down above is done when it returns."""

    def restore_blocks(self, pairs: list[tuple[int, int]]) -> None:
        started = time.perf_counter()
        for host_block, device_block in pairs:
            for name, pool in self._kv_pools().items():
                pool[device_block] = self.host_states[name][host_block]
        self.restore_time += time.perf_counter() - started

    def restore_done(self, handle: None) -> bool:
        """The copies back are done when restore_blocks returns."""
        return True

    def restore_seconds(self) -> float:
        return self.restore_time

    def _kv_pools(self) -> dict[str, np.ndarray]:
        """The paged caches: states whose first dim is the block pool's."""
        return {name: self.states[name] for name, t in self.graph.expanded_states().items()
                if t.shape[0] == "num_blocks"}

    def copy_state(self, src: int, dst: int) -> None:
        for name in self.pooled:
            self.states[name][dst] = self.states[name][src]

    def release(self, seq: Sequence) -> None:
        release_sequence(self.allocator, seq)
