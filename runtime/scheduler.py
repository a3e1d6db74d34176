"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step packs, under a token budget (max_num_batched_tokens), one decode token of each running sequence that
is decoding, then prompt chunks of running sequences still prefilling (chunked prefill), then new requests
admitted from the waiting queue. A sequence is one `Sequence` whose tokens are prompt and generated tokens alike,
so a prefill chunk, a decode token and the recompute of a preempted sequence are the same thing: its next uncached
tokens. The engine is anything with `sample(chunks, params, token_index, constraints) -> SampleResult`,
`step(chunks, all_logits=True)` (prompt chunks of requests wanting prompt logprobs run apart through it),
`release(seq)` and `.allocator` (the reference engine on the CPU, the GPU engine): tokens are drawn where the logits
are.

Admission is fair between groups (the choices of one API request share a group): preempted sequences resume
first, then the next is the oldest waiting request of the group with the fewest running sequences. So while one
group holds every running slot, another group's request is admitted at the first step after any of them finishes
(if it fits), not behind the first group's other waiting sequences. Ungrouped requests go in arrival order.

KV memory: a request whose prompt and max_tokens can never fit the pool is refused when added, with its numbers. A
waiting request is admitted only when its whole uncached sequence fits beside what the step already takes; it waits
otherwise, and the requests behind it with it. When a running sequence needs a block and none is left (after evicting
unreferenced prefix-cache blocks), the newest running sequence not yet in the step is preempted: its blocks are
released and it goes back to the head of the queue, to be recomputed from its tokens later. A prefix hit on host blocks
(runtime/host_tier.py) holds them as they come back and admits the request once they have landed. An abort frees a
request's blocks at once. A model with recurrent layers also gives each running sequence a state slot (freed with its
blocks, so running sequences never outnumber the slots); its prefix hits restore the state snapshotted at a cached
block boundary (runtime/state_snapshots.py), and its prompt chunks end on block boundaries to make them.

A step is plain (runtime/plain_step.py: launched, waited for, read) or, with async scheduling, launched before the
step in flight is read (runtime/overlap.py).
"""

import itertools
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pegainfer.errors import RequestError
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.engine_api import Engine
from pegainfer.runtime.host_tier import HostTier
from pegainfer.runtime.kv_blocks import check_fits
from pegainfer.runtime.lora import LoraSlots
from pegainfer.runtime.overlap import Overlap, overlappable
from pegainfer.runtime.plain_step import run_plain_step
from pegainfer.runtime.prefix_cache import PrefixCache, root_for
from pegainfer.runtime.request_state import RequestState
from pegainfer.runtime.requests import EngineRequest, TokenOutput
from pegainfer.runtime.spec_steps import SpecSteps
from pegainfer.runtime.speculative import Speculator
from pegainfer.runtime.state_snapshots import StateSnapshots, chunk_to_boundary
from pegainfer.runtime.step_stats import SchedulerStats, StepRecord
from pegainfer.runtime.waiting import WaitingQueue


# Why a model with recurrent layers may run without the prefix cache: a hit needs each layer's state as it was after
# the cached prefix, and the engine kept no rows to snapshot it in.
NO_PREFIX_CACHE_FOR_RECURRENT = ("its recurrent layers' state needs snapshots at cached block boundaries and the "
                                 "engine keeps no rows for them (--state-snapshots 0)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    prefix_cache: bool = True
    async_scheduling: bool = True  # where the engine and the requests allow it (runtime/overlap.py)


class Scheduler:
    def __init__(self, engine: Engine, eos_ids: frozenset[int], config: SchedulerConfig = SchedulerConfig(),
                 speculator: Speculator | None = None, lora: LoraSlots | None = None,
                 host: HostTier | None = None) -> None:
        """`speculator`: drafts verified in the steps (runtime/speculative.py); `lora`: the adapters requests may
        name, over the engine's LoRA tables (runtime/lora.py); `host`: evicted cached blocks kept in host memory
        (runtime/host_tier.py)."""
        assert config.max_num_seqs >= 1 and config.max_model_len >= 2, config
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({config.max_num_seqs}): every running sequence's decode token must fit in a step")
        self.engine, self.eos_ids, self.config, self.allocator = engine, eos_ids, config, engine.allocator
        slots = self.allocator.state_slots
        if slots and config.max_num_seqs > slots:
            raise ValueError(f"max_num_seqs ({config.max_num_seqs}) must be at most the engine's state slots "
                             f"({slots}): every running sequence of a model with recurrent layers holds one")
        self.speculator, self.lora = speculator, lora
        self.stats = SchedulerStats()
        self.spec = speculator and SpecSteps(speculator, engine, bool(slots), config, self.stats)
        self.block_size = self.allocator.block_size
        rows = self.allocator.snapshot_rows if config.prefix_cache and slots else range(0)
        self.snapshots = StateSnapshots(rows) if rows else None
        if host is not None and (slots or not config.prefix_cache):
            raise ValueError("a host KV tier keeps prefix-cache blocks of a model without recurrent layers")
        self.host = host
        on_evict = (lambda block_hash, _: self.snapshots.drop(block_hash)) if self.snapshots else host and host.settle
        self.cache = PrefixCache(self.allocator, on_evict, host and host.keep) \
            if config.prefix_cache and (rows or not slots) else None
        self.waiting = WaitingQueue()
        self.running: list[RequestState] = []
        self.rng = np.random.default_rng()  # seeds of first tokens drawn here for seedless requests
        self._states: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._seq_ids = itertools.count()
        self._reserved = 0
        self.last_step: StepRecord | None = None
        self.overlap = Overlap(self) if config.async_scheduling and getattr(engine, "overlaps", False) and not \
            speculator else None

    # --- requests in and out ---------------------------------------------------------------------------------

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Refuses a request that could never run, whatever else is running; the numbers say why."""
        check_fits(self.allocator, prompt_len, max_tokens, self.config.max_model_len)

    def add(self, request: EngineRequest) -> None:
        assert request.request_id not in self._states, f"request id {request.request_id!r} is already in use"
        if request.lora is not None and (self.lora is None or request.lora not in self.lora.adapters):
            raise RequestError(f"the LoRA adapter {request.lora!r} is not loaded")
        request.params.validate()
        self.check(len(request.prompt_ids), request.params.max_tokens)
        seq = Sequence(next(self._seq_ids), list(request.prompt_ids))
        root = root_for(self.lora.cache_key(request.lora) if request.lora is not None else None, request.cache_salt)
        state = RequestState(request, seq, root=root,  # hits never cross adapters, nor salts
                             overlappable=overlappable(request, getattr(self.engine, "penalties_in_tail", False)))
        self._states[request.request_id] = state
        self._by_seq[seq.seq_id] = state
        self.waiting.append(state)

    def abort(self, request_id: str) -> bool:
        """Drops a request (its client is gone); its KV blocks are free when this returns."""
        state = self._states.get(request_id)
        if state is None:
            return False
        if state in self.running:
            self._stop(state)
            self._free(state)
        else:
            self.waiting.remove(state)
            if state.restoring:  # blocks it held while its host blocks came back
                self.host.let_go(self.cache, [state])
        self._forget(state)
        return True

    def prefix_cache_status(self) -> str:
        """"on", "off", or off with the reason when it was asked for and the model cannot have it."""
        if self.cache is not None:
            snapshots = self.snapshots
            return f"on (recurrent state kept at up to {snapshots.capacity} block boundaries)" if snapshots else "on"
        return f"off ({NO_PREFIX_CACHE_FOR_RECURRENT})" if self.config.prefix_cache else "off"

    def lora_in_use(self, name: str) -> bool:
        """Whether a running or waiting request runs with LoRA adapter `name`."""
        return any(state.request.lora == name for state in (*self.running, *self.waiting))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running) or self.in_flight

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's tokens are still to be read (async scheduling)."""
        return self.overlap is not None and self.overlap.in_flight is not None

    def state_of(self, chunk: Chunk) -> RequestState | None:
        return self._by_seq.get(chunk.seq.seq_id)

    @property
    def blocks_in_use(self) -> int:
        """Blocks some request holds; free and evictable cached blocks are not in use."""
        evictable = self.cache.num_evictable if self.cache else 0
        return self.allocator.num_blocks - self.allocator.num_free - evictable

    # --- one step --------------------------------------------------------------------------------------------

    def step(self, launched: Callable[[], None] | None = None) -> list[TokenOutput]:
        """Schedules, runs the engine once and samples; returns the tokens made (none when idle). `launched` is
        called once the engine has queued the step, before it waits for it (the engine loop's hand-over). With
        async scheduling the tokens returned may be those of the step launched by the call before."""
        if self.overlap is not None:
            return self.overlap.step(launched)
        return self.run_step(self.schedule(), launched)

    def run_step(self, chunks: list[Chunk], launched: Callable[[], None] | None = None) -> list[TokenOutput]:
        """Runs the scheduled chunks and reads their tokens before returning (runtime/plain_step.py)."""
        return run_plain_step(self, chunks, launched)

    def schedule(self, ahead: bool = False) -> list[Chunk] | None:
        """`ahead`: while a step is in flight (runtime/overlap.py), None where a sequence would have to be
        preempted, and only requests that can overlap are admitted."""
        budget, self._reserved = self.config.max_num_batched_tokens, 0
        chunks: list[Chunk] = []
        scheduled: set[int] = set()
        preempted = False
        running, preemptions = list(self.running), self.stats.preemptions
        drafts = self.spec.propose(running) if self.spec else {}
        decodes = sum(len(st.seq.token_ids) - st.seq.num_cached == 1 for st in running) if drafts else 0
        for decoding in (True, False):
            for state in running:
                uncached = len(state.seq.token_ids) - state.seq.num_cached
                if (uncached == 1) != decoding or budget == 0 or state.drafts or state.ending:  # drafts: decoding
                    continue
                if self.stats.preemptions != preemptions and state not in self.running:
                    continue  # preempted earlier in this step (a membership test only then: it is linear)
                count = self._chunk(state, min(uncached, budget, self.config.max_num_seqs if state.scoring else budget))
                decodes -= decoding
                room = self._room_for(state, count, scheduled, ahead)
                if room is None:
                    return None
                if not room:
                    preempted = True
                    continue
                draft = self.spec.fit(state, drafts[state.seq.seq_id], budget - count - decodes,
                                      self._reserve_drafts(state)) if state.seq.seq_id in drafts else []
                chunks.append(Chunk(state.seq, count + len(draft), draws=1 + len(draft)))
                scheduled.add(state.seq.seq_id)
                budget -= count + len(draft)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            state = self.waiting.peek()
            if ahead and not state.overlappable:
                break
            count = self._admit(state, min(budget, self.config.max_num_seqs) if state.scoring else budget)
            if count == 0:
                if self.host is not None and not state.restoring:  # it may need what others hold while restoring
                    self.host.let_go(self.cache)
                break
            self.waiting.popleft()
            self.running.append(state)
            self.waiting.started(state)
            chunks.append(Chunk(state.seq, count))
            budget -= count
        return chunks

    def _room_for(self, state: RequestState, count: int, scheduled: set[int], ahead: bool) -> bool | None:
        """Reserves the blocks `count` more tokens of a running sequence need, preempting the newest running
        sequences not yet in this step while there are none; False when `state` itself had to go, None where one
        would have to go `ahead` of the step in flight."""
        need = self._blocks_needed(state.seq, count)
        if need == 0:
            return True
        while not self._reserve(need):
            if ahead:
                return None
            victim = next(s for s in reversed(self.running) if s.seq.seq_id not in scheduled)
            self.preempt(victim)
            if victim is state:
                return False
        return True

    def _admit(self, state: RequestState, budget: int) -> int:
        """Takes the waiting request's prefix-cache hit and reserves its first chunk's blocks when its whole
        sequence fits now; returns the chunk's token count, or 0 to leave it waiting."""
        seq, tokens = state.seq, state.seq.token_ids
        if state.restoring:  # its host blocks on their way back: held until they land, then found cached
            if not self.host.landed(state.restoring):
                return 0
            self.host.let_go(self.cache, [state])
        cached_ok = self.cache is not None and not state.scoring  # a cached block has no logits to score
        limit = (len(tokens) - 1) // self.block_size  # a prompt token is left to compute, for the logits
        blocks, hashes = self.cache.lookup(tokens, limit, state.root) if cached_ok else ([], [])
        if self.snapshots:  # a recurrent layer resumes only where its state was snapshotted
            blocks, hashes = blocks[:(hit := self.snapshots.deepest(hashes))], hashes[:hit]
        restored = self.host.lookup(tokens, len(blocks), hashes[-1] if hashes else state.root, limit) \
            if self.host is not None and cached_ok else []
        evictable = self.cache.num_evictable - self.cache.count_evictable(blocks) if self.cache else 0
        available = self.allocator.num_free - self._reserved + evictable
        if self.allocator.blocks_for(len(tokens)) - len(blocks) > available or \
                self.host is not None and not self.host.landed(blocks):  # another request's restore in flight
            return 0
        if restored:
            self.cache.acquire(blocks)
            self.host.hold(state, blocks + self.host.bring_back(restored, self.cache, self.allocator, self._reserved))
            return self._admit(state, budget)  # at once where the copies are done (the CPU engine's)
        if not self._take_adapter(state):
            return 0
        cached = len(blocks) * self.block_size
        if self.cache:
            self.cache.acquire(blocks)
            self.cache.record_query(len(tokens), cached)
        seq.table.blocks, seq.num_cached, state.block_hashes = list(blocks), cached, list(hashes)
        if not state.admitted:
            state.admitted, state.num_cached_tokens, state.first_scheduled = True, cached, time.monotonic()
            self.stats.prompt_tokens += len(tokens)
        if self.snapshots and hashes:
            self.engine.copy_state(self.snapshots.restore(hashes[-1]), self.allocator.take_slot(seq.table))
        count = self._chunk(state, min(len(tokens) - cached, budget))
        assert self._reserve(self._blocks_needed(seq, count)), "admission checked that the sequence fits"
        return count

    def _take_adapter(self, state: RequestState) -> bool:
        """A LoRA table slot holding the request's adapter; False while other adapters' sequences hold them all."""
        slot = self.lora.acquire(state.request.lora) if state.request.lora is not None else -1
        state.seq.lora_slot = -1 if slot is None else slot
        return slot is not None

    def _chunk(self, state: RequestState, count: int) -> int:
        """A prompt chunk of a model with state snapshots ends on a block boundary where it crosses one."""
        return chunk_to_boundary(state.seq.num_cached, count, self.block_size) if self.snapshots else count

    def _reserve_drafts(self, state: RequestState) -> Callable[[int], bool]:
        """Whether the blocks of `count` drafts after the state's decode token can be had without preempting."""
        seq = state.seq
        return lambda count: self._reserve(self._blocks_needed(seq, 1 + count) - self._blocks_needed(seq, 1))

    def _blocks_needed(self, seq: Sequence, count: int) -> int:
        return max(self.allocator.blocks_for(seq.num_cached + count) - len(seq.table.blocks), 0)

    def _reserve(self, need: int) -> bool:
        """Makes `need` more blocks free for this step (evicting unreferenced cached blocks first)."""
        short = self._reserved + need - self.allocator.num_free
        if short > 0 and self.cache:
            self.cache.evict(short)
        if self._reserved + need > self.allocator.num_free:
            return False
        self._reserved += need
        return True

    def preempt(self, state: RequestState) -> None:
        """Back to the head of the queue, its blocks freed: recomputed from its tokens when admitted again."""
        self._stop(state)
        self._free(state)
        self.waiting.appendleft(state)
        self.stats.preemptions += 1

    def _stop(self, state: RequestState) -> None:
        self.running.remove(state)
        self.waiting.stopped(state)

    def _free(self, state: RequestState) -> None:
        """Cached blocks lose a reference and stay cached; the sequence's own blocks go back to the pool."""
        if self.cache:
            state.seq.table.blocks = self.cache.release(state.seq.table.blocks)
        self.engine.release(state.seq)
        state.block_hashes = []
        for _, row in state.unnamed_snapshots:  # copied at launches whose reads never named them
            self.snapshots.release(row)
        state.unnamed_snapshots = []
        if self.spec:
            self.spec.release(state.seq.seq_id)
        if state.seq.lora_slot >= 0:
            self.lora.release(state.seq.lora_slot)
            state.seq.lora_slot = -1

    def _forget(self, state: RequestState) -> None:
        del self._states[state.request.request_id], self._by_seq[state.seq.seq_id]

    # --- after the step --------------------------------------------------------------------------------------

    def append(self, state: RequestState, token: int, logprobs: dict[int, float] | None, now: float) -> TokenOutput:
        state.seq.token_ids.append(token)
        state.num_generated += 1
        return self.emit(state, token, logprobs, now, state.num_generated, len(state.seq.token_ids))

    def emit(self, state: RequestState, token: int, logprobs: dict[int, float] | None, now: float, generated: int,
             length: int) -> TokenOutput:
        """The output of a request's `generated`-th token (its sequence `length` tokens long with it), finishing
        the request where the token stops it or reaches a limit."""
        params = state.request.params
        self.stats.generation_tokens += 1
        finish = None
        if (token in self.eos_ids and not params.ignore_eos) or token in state.request.stop_token_ids:
            finish = "stop"
        elif generated >= params.max_tokens or length >= self.config.max_model_len:
            finish = "length"
        if finish:
            self._stop(state)
            self._free(state)
            self._forget(state)
        return TokenOutput(state.request.request_id, token, logprobs, finish, state.num_cached_tokens, now,
                           state.first_scheduled)
