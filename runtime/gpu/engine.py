"""The GPU engine: the same step interface as the reference engine (chunks in, logits out), on the GPU, with
decode steps and speculation's verify steps replayed from CUDA graphs captured per batch bucket (runtime/gpu/
step_padding.py). For a sharded model one engine runs each rank (runtime/gpu/nccl.py joins them): the driver's
engine tells `on_step` each step it is about to launch, and every other rank's engine `execute`s that same step, so
that all issue the same NCCL calls in the same order."""

from collections.abc import Callable, Collection
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pegainfer.errors import PegainferError
from pegainfer.frontends.features import FEATURES
from pegainfer.frontends.load import LoadedModel
from pegainfer.ir.step import (LORA_SLOTS, TOKEN_BITMASK, has_recurrent_state, mask_words, penalty_capacity,
                               sampler_outputs)
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence, commit_step, pack_step, release_sequence
from pegainfer.runtime.constraint import TokenConstraint
from pegainfer.runtime.device_sampling import (SampleResult, device_masks, finish, mask_inputs, penalty_inputs,
                                               sampling_inputs, wants_top_logprobs)
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.collectives import Communicator
from pegainfer.runtime.gpu.executor import PDL_MAX_TOKENS, GpuExecutor, Limits
from pegainfer.runtime.gpu.host_blocks import HostBlocks
from pegainfer.runtime.gpu.memory import kv_blocks_for_memory
from pegainfer.runtime.gpu.nccl import NcclCommunicator, Rendezvous
from pegainfer.runtime.gpu.step_padding import (PADDING_BLOCK, PADDING_SLOT, pad_decode_step, pad_verify_step,
                                                verify_rows)
from pegainfer.runtime.gpu.upload import borrowed_params
from pegainfer.runtime.kv_blocks import BlockAllocator
from pegainfer.runtime.pending_tokens import PENDING, copy_runs, pending_rows
from pegainfer.runtime.sampler import SamplingParams


FEATURES_WITH_TOKENS = 1 << 18  # bytes of a step's feature rows downloaded with its tokens (the rest: on their own)


def decode_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_batch."""
    return sorted({b for b in (1, 2, 4, 8) if b <= max_batch} | set(range(8, max_batch + 1, 8)) | {max_batch})


def bucket_for(batch: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= batch)


@dataclass
class EngineOptions:
    max_tokens: int = 2048
    max_batch: int = 256
    max_model_len: int = 4096
    kv_tokens: int | None = None  # the KV cache's size in tokens; None: from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # of the device's memory, for weights, activations and the KV cache
    block_size: int = 16
    cuda_graphs: bool = True
    pdl_max_tokens: int = PDL_MAX_TOKENS  # programmatic dependent launch for steps of at most this many tokens
    state_snapshots: int | None = None  # recurrent state rows kept for the prefix cache; None: max_batch
    spare_states: int = 0  # recurrent state rows speculating sequences roll back to (runtime/spec_steps.py)
    max_samples: int = 0  # rows of logits a step draws at most, past one a sequence (speculation); 0: max_batch
    verify_tokens: int = 0  # K + 1 when speculating K tokens: the width of the verify steps' graphs (0: none)
    reserved_bytes: int = 0  # memory left out of the budget for a draft model's engine (its weights, activations)
    kv_share: float = 1.0  # of the KV budget, the share this pool takes (the rest: a draft model's KV)
    device: int = 0  # the CUDA device's ordinal (a rank's GPU)


@dataclass(frozen=True)
class StepPlan:
    """How a step is launched, which every rank of a sharded model must repeat: eagerly (bucket None) or as the
    CUDA graph of a bucket of sequences of `width` tokens (decode: 1; verify: K + 1), the step padded to it, its
    sampler tail captured apart (`split`) or not."""
    bucket: int | None
    split: bool = False
    width: int = 1


StepHook = Callable[[dict[str, np.ndarray], StepPlan], None]  # a step's packed inputs and plan, before its launch


class GpuEngine:
    token_output: str | None = None  # the output of a row per token that sample() brings back: a drafter's features
    overlaps = penalties_in_tail = True  # launches ahead of reads (runtime/overlap.py); the tail draws penalties
    launches = 0  # steps launched by `launch`, and the last one's draws (seq_id -> row, the device ids)
    drawn: tuple[dict[int, int], DeviceTensor | None] = ({}, None)

    def __init__(self, model: LoadedModel, manifest: Path, options: EngineOptions = EngineOptions(),
                 communicator: Communicator | Rendezvous | None = None, on_step: StepHook | None = None, *,
                 lenders: Seq[tuple["GpuEngine", Collection[str] | None]] = (),
                 kv_of: "GpuEngine | None" = None) -> None:
        """One rank of a sharded model takes a communicator, or the Rendezvous to make one (with this engine's
        context current, before the KV cache takes the memory left); `on_step` hears of every step first. A draft
        head's engines borrow params from `lenders` (an engine, and the names it may lend, None: any it holds
        alike: its target's embedding), and its second graph takes the first's KV cache, stream and block
        allocator (`kv_of`)."""
        self.model, self.options, self.on_step = model, options, on_step
        self.ctx = kv_of.ctx if kv_of is not None else driver.Context.create(options.device)
        if isinstance(communicator, Rendezvous):
            communicator = NcclCommunicator(communicator, self.ctx.stream)
        self.communicator = communicator
        lowered, _ = lower(model.spec.graph)
        limits = Limits(options.max_tokens, options.max_batch, -(-options.max_model_len // options.block_size),
                        0, options.block_size, max_samples=options.max_samples,
                        penalties=penalty_capacity(options.max_samples or options.max_batch))
        self.executor = GpuExecutor(self.ctx, lowered, manifest, model.weights, limits, communicator,
                                    borrowed_params(lowered, [(e.executor, names) for e, names in lenders]))
        slots = options.max_batch + PADDING_SLOT + 1 if has_recurrent_state(lowered) else 0  # one per sequence
        snapshots = options.max_batch if options.state_snapshots is None else options.state_snapshots
        if slots:
            self.executor.allocate_state_pools(slots + snapshots + options.spare_states)
        self._slots = (slots, snapshots)
        if kv_of is None:
            num_blocks = self._kv_blocks()
            self.executor.allocate_kv(num_blocks)
            self.allocator = self._allocator(num_blocks)
        else:
            self.executor.share_kv(kv_of.executor)
            self.allocator = kv_of.allocator
        self.executor.pdl_max_tokens = options.pdl_max_tokens
        self.buckets = decode_buckets(options.max_batch)
        self.graphs: dict[tuple[int, int, bool], tuple[tuple[driver.Graph, ...], dict]] = {}  # bucket, width, split
        self.rng = np.random.default_rng()  # seeds for requests that have none
        self.vocab_size = lowered.value_types()[lowered.outputs[0]].shape[-1]  # the logits' width
        self.no_masks = np.zeros((1, mask_words(self.vocab_size)), dtype=np.int32)
        self.host_blocks: HostBlocks | None = None  # the host KV tier's pinned pool (allocate_host_blocks)
        self.token_output = FEATURES if FEATURES in lowered.outputs else None

    def _kv_blocks(self) -> int:
        """Blocks of the KV cache, the padding block included: from kv_tokens, or what the memory allows. A pool
        smaller than max_model_len is the caller's to refuse or clamp to (allocator.num_blocks * block_size)."""
        options = self.options
        if options.kv_tokens is not None:
            return -(-options.kv_tokens // options.block_size) + PADDING_BLOCK + 1
        free, total = driver.device_memory()
        blocks = kv_blocks_for_memory(options.gpu_memory_utilization, self.executor.kv_bytes_per_block(),
                                      free - options.reserved_bytes, total)
        return max(int(blocks * options.kv_share), PADDING_BLOCK + 2)

    @property
    def kv_blocks(self) -> int:
        """The KV pool's blocks, the padding block included (what limit_kv_blocks takes)."""
        return self.executor.limits.num_blocks

    def limit_kv_blocks(self, num_blocks: int) -> None:
        """Hands out only the first `num_blocks` blocks (a sharded model's ranks agree on the fewest any of them
        holds, so a block table is valid on all); before the first step."""
        if not PADDING_BLOCK + 1 < num_blocks <= self.kv_blocks:
            raise PegainferError(f"limit_kv_blocks({num_blocks}): expected 2 .. {self.kv_blocks} blocks (this "
                                 f"engine's pool, the padding block included)")
        self.allocator = self._allocator(num_blocks)

    def _allocator(self, num_blocks: int) -> BlockAllocator:
        return BlockAllocator(num_blocks, self.options.block_size, reserved=PADDING_BLOCK + 1,
                              state_slots=self._slots[0], snapshot_slots=self._slots[1],
                              spare_slots=self.options.spare_states)

    def step(self, chunks: list[Chunk], *, all_logits: bool = False) -> np.ndarray:
        """Runs one step and returns float32 logits, one row per chunk (or per token with all_logits)."""
        rows = sum(c.num_tokens for c in chunks) if all_logits else len(chunks)
        outputs = self.run(chunks, all_logits=all_logits)
        return self.executor.fetch(outputs["logits"])[:rows].astype(np.float32)

    def sample(self, chunks: list[Chunk], params: list[SamplingParams], token_index: list[int],
               constraints: list[TokenConstraint | None] | None = None,
               launched: Callable[[], None] | None = None,
               inputs: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None) -> SampleResult:
        """`launch`, then `launched()` (the step and its downloads queued, before the wait), then its result."""
        result = self.launch(chunks, params, token_index, constraints, inputs)
        if launched is not None:
            launched()
        return result()

    def launch(self, chunks: list[Chunk], params: list[SamplingParams], token_index: list[int],
               constraints: list[TokenConstraint | None] | None = None,
               inputs: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
               before_masks: Callable[[], Collection[int]] | None = None) -> Callable[[], SampleResult]:
        """Queues a step drawing a token per chunk (the tail's `sample` op, under grammar bitmasks and penalties)
        and its downloads; the call it returns waits for those: tokens, logprobs, top-k candidates where a row asks
        top logprobs, a logits row only for a row the device left unresolved or whose constraint the tail cannot
        take (device_sampling.finish draws it), or `stale` where a later launch overwrote the logits. `inputs(step)`:
        graph inputs of its own (a draft head's features; token_output rows back as `features`). `before_masks()`:
        called once the layers are queued, before the masks are filled; the rows it gives draw unconstrained."""
        sampling = sampling_inputs(params, token_index, self.rng)
        masks: dict[int, np.ndarray] = {}
        penalized: set[int] = set()
        live = list(constraints or [])

        def fill_late(rows: int) -> dict[str, np.ndarray]:  # while the GPU runs the layers
            for row in before_masks() if before_masks is not None else ():
                live[row] = None
            masks.update(device_masks(live, self.vocab_size))
            penalties, on_device = penalty_inputs(live, params, rows, self.executor.limits.penalties)
            penalized.update(on_device)
            return mask_inputs(rows, masks) | (penalties if on_device else {})
        self.launches += 1  # before the layers: a step read inside this one's fill_late finds its logits gone
        launch, constrained = self.launches, any(c is not None for c in live)
        outputs, draws, tokens = self._run(chunks, False, sampling, fill_late if constrained else None, verify=True,
                                           inputs=inputs)
        rows = np.arange(len(params)) if draws is None else draws  # the draws' rows of the step's outputs
        names = sampler_outputs(self.executor.graph)
        self.drawn = ({c.seq.seq_id: int(r) for c, r in zip(chunks, rows)} if len(rows) == len(chunks) else {},
                      outputs[names["sampled_ids"]])
        wanted = ["sampled_ids", "sampled_logprobs", *(("top_values", "top_ids", "logsumexp")
                                                 if wants_top_logprobs(params) else ())]
        features = outputs[self.token_output] if self.token_output is not None else None
        together = features is not None and features.nbytes <= FEATURES_WITH_TOKENS and features.dense
        download = self.executor.fetch_later([outputs[names[role]] for role in wanted] + [features] * together)

        def result() -> SampleResult:
            assert self.launches - launch <= 1, "a step's downloads are read before a second launch reuses them"
            fetched = download()
            logits = outputs[self.executor.graph.outputs[0]]
            result = finish({role: array[rows] for role, array in zip(wanted, fetched)}, sampling, params,
                            lambda row: self.executor.fetch(logits.row(int(rows[row])))[0].astype(np.float32),
                            live or None, masks, penalized, logits_gone=self.launches != launch)
            if features is not None:  # a decode or verify step's rows come back with its tokens, in one wait
                result.features = (fetched[-1] if together else self.executor.fetch(features))[tokens]
            return result
        return result

    def run(self, chunks: list[Chunk], *, all_logits: bool = False, sampling: dict | None = None,
            fill_late: Callable[[int], dict[str, np.ndarray]] | None = None) -> dict:
        """Launches one step; `sampling` (device_sampling.sampling_inputs) replaces the greedy defaults;
        `fill_late(rows)`, called once the layers are queued, gives the step inputs of the rows' grammar bitmasks
        and penalties (device_masks, penalty_inputs), uploaded ahead of the sampler tail."""
        return self._run(chunks, all_logits, sampling, fill_late)[0]

    def _run(self, chunks: list[Chunk], all_logits: bool, sampling: dict | None,
             fill_late: Callable[[int], dict[str, np.ndarray]] | None, verify: bool = False,
             inputs: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
             ) -> tuple[dict, np.ndarray | None, np.ndarray | slice]:
        """run's outputs, the rows of the step's draws among them where a verify graph padded it (None: the first
        rows), and the rows of its tokens (a slice of the first ones where no verify graph padded it); `verify`:
        the caller reads the draws by those rows (sample does), so a verify graph may run."""
        # full-width bitmask rows even when none is used: a captured graph keeps the row stride it was captured with
        step = pack_step(chunks, self.allocator, all_logits=all_logits, lora=self.lora) | (sampling or {}) | \
            {TOKEN_BITMASK: self.no_masks}
        if inputs is not None:
            step |= inputs(step)
        plan, draws = self._plan(chunks, step, all_logits, fill_late is not None, verify), None
        tokens = slice(0, len(step["input_ids"]))
        if plan.width > 1:
            tokens = verify_rows(step["query_lens"], plan.width)
            step, draws = pad_verify_step(step, plan.bucket, plan.width)
        elif plan.bucket is not None:
            step = pad_decode_step(step, plan.bucket)
        rows = len(step["logits_indices"])
        before_tail = None if fill_late is None else (lambda: self.executor.upload_inputs(fill_late(rows)))
        if self.on_step is not None:
            self.on_step(step, plan)
        pending = (step["input_ids"] == PENDING).any()
        copies = copy_runs(pending_rows(chunks, step["seq_starts"], self.drawn[0])) if pending else []
        assert not copies or plan.width == 1, "a verify step takes no pending tokens"
        outputs = self._launch(step, plan, before_tail, copies)
        commit_step(chunks)
        return outputs, draws, tokens

    def _plan(self, chunks: list[Chunk], step: dict[str, np.ndarray], all_logits: bool, split: bool,
              verify: bool = True) -> StepPlan:
        """A decode step's graph; a verify step's (at most verify_tokens a sequence, each drawn at every token or at
        its last only, none under a grammar, for a caller that reads the draws by row: `verify`), where its bucket
        fits the limits and every sequence's context with its padding fits the block table; else eager launches.
        A recurrent model's sequences take no padding tokens: its verify graphs are as wide as its sequences, all of
        one length (drafts, or the kept tokens run again after a rejected draft)."""
        options, limits = self.options, self.executor.limits
        if not options.cuda_graphs or all_logits:
            return StepPlan(None, split)
        if all(c.num_tokens == 1 for c in chunks):
            return StepPlan(bucket_for(len(chunks), self.buckets), split)
        width, lengths = options.verify_tokens, {c.num_tokens for c in chunks}
        if self._slots[0]:
            width = lengths.pop() if len(lengths) == 1 and max(lengths) <= width else 0
        if not verify or split or width <= 1 or any(c.num_tokens > width for c in chunks) or \
                any(c.draws not in (1, c.num_tokens) for c in chunks):
            return StepPlan(None, split)
        bucket = bucket_for(len(chunks), self.buckets)
        longest = int((step["context_lens"] - step["query_lens"]).max()) + width
        if bucket * width > min(limits.max_tokens, limits.samples) or \
                longest > limits.max_blocks_per_seq * limits.block_size:
            return StepPlan(None, split)
        return StepPlan(bucket, split, width)

    def execute(self, step: dict[str, np.ndarray], plan: StepPlan) -> dict:
        """Runs the step another rank's engine packed and planned (its on_step's arguments) exactly as that one
        does: the same graph or eager launches, so the same NCCL calls in the same order; nothing is drawn or
        downloaded (the driver's rank does that). Waits for this rank's previous step first, whose upload the
        staging memory still holds."""
        self.ctx.synchronize()
        return self._launch(step, plan, (lambda: None) if plan.split else None)

    def _launch(self, step: dict[str, np.ndarray], plan: StepPlan, before_tail: Callable[[], None] | None,
                copies: list[tuple[int, int, int]] = ()) -> dict:
        skip = skipped_kinds(step)
        if plan.bucket is not None:
            return self._replay(step, plan, before_tail, skip, copies)
        return self.executor.run(self._upload(step, copies), before_tail, skip)

    def _upload(self, step: dict[str, np.ndarray], copies: list[tuple[int, int, int]]) -> dict[str, int]:
        """The step's inputs up, then the last step's draws over its pending tokens' rows: (input, draw, count) runs."""
        sizes, drawn = self.executor.upload_step(step), self.drawn[1]
        for dst, src, count in copies:
            assert drawn.dtype.itemsize == 4, f"token ids of 4 bytes, the draws are {drawn.dtype}"
            ids = self.executor.input_region + self.executor.inputs["input_ids"][0]
            driver.copy_on_device(ids + 4 * dst, drawn.ptr + 4 * src, 4 * count, self.ctx.stream)
        return sizes

    def _replay(self, step: dict[str, np.ndarray], plan: StepPlan, before_tail: Callable[[], None] | None,
                skip: frozenset[str], copies: list[tuple[int, int, int]] = ()) -> dict:
        """The bucket's captured graph; with `before_tail`, its layers and its sampler tail captured apart, so that
        the host fills the grammar masks between the two replays while the GPU runs the layers."""
        key = (plan.bucket, plan.width, before_tail is not None, skip)
        sizes = self._upload(step, copies)
        if key not in self.graphs:
            self.ctx.synchronize()
            self.graphs[key] = self._capture_split(sizes, skip) if key[2] else self._capture(sizes, skip)
        graphs, outputs = self.graphs[key]
        graphs[0].replay()
        if before_tail is not None:
            before_tail()
            graphs[1].replay()
        return outputs

    def _capture(self, sizes: dict[str, int], skip: frozenset[str]) -> tuple[tuple[driver.Graph, ...], dict]:
        with driver.Graph(self.ctx.stream) as graph:
            outputs = self.executor.run(sizes, skip=skip)
        return (graph,), outputs

    def _capture_split(self, sizes: dict[str, int], skip: frozenset[str]) -> tuple[tuple[driver.Graph, ...], dict]:
        body, tail = driver.Graph(self.ctx.stream), driver.Graph(self.ctx.stream)
        capturing = [body.__enter__()]

        def switch() -> None:
            body.__exit__(None, None, None)
            capturing[0] = tail.__enter__()
        try:
            outputs = self.executor.run(sizes, before_tail=switch, skip=skip)
        except BaseException as error:
            capturing[0].__exit__(type(error), error, error.__traceback__)  # the stream leaves capture mode
            raise
        assert capturing[0] is tail, "the graph has no sampler tail to capture apart"
        tail.__exit__(None, None, None)
        return (body, tail), outputs

    def copy_state(self, src: int, dst: int) -> None:
        self.executor.copy_state_row(src, dst)

    def kv_bytes_per_block(self) -> int:
        return self.executor.kv_bytes_per_block()

    def allocate_host_blocks(self, host_blocks: int) -> None:
        """The host tier's pinned pool (runtime/gpu/host_blocks.py), at start: pinning takes a while."""
        paged = {name: self.executor.states[name] for name in self.executor.paged_states()}
        self.host_blocks = HostBlocks(self.ctx.stream, paged, host_blocks)

    def offload_block(self, device_block: int, host_block: int) -> None:
        """A cached block copied down into the host tier's pinned pool, on its side stream."""
        self.host_blocks.offload(device_block, host_block)

    def settle_block(self, device_block: int) -> None:
        self.host_blocks.settle(device_block)

    def restore_blocks(self, pairs: list[tuple[int, int]]) -> int:
        return self.host_blocks.restore(pairs)

    def restore_done(self, handle: int) -> bool:
        return self.host_blocks.landed(handle)

    def restore_seconds(self) -> float:
        return self.host_blocks.restore_seconds()

    @property
    def graph(self):
        """The model's graph as declared (LoRA tables included, frontends/lora.py), before lowering."""
        return self.model.spec.graph

    @property
    def lora(self) -> bool:
        return LORA_SLOTS in self.model.spec.graph.inputs

    def write_lora(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        """An adapter's rows (frontends/lora.adapter_rows) into one slot of every LoRA table, in stream order."""
        for name, row in rows.items():
            self.executor.write_row(name, slot, row)

    def release(self, seq: Sequence) -> None:
        release_sequence(self.allocator, seq)


def skipped_kinds(step: dict[str, np.ndarray]) -> frozenset[str]:
    """The kernels a step may leave out: LoRA's in-place updates when none of its rows has an adapter."""
    slots = step.get(LORA_SLOTS)
    return frozenset(("lora_add",)) if slots is not None and not (slots >= 0).any() else frozenset()


def missing_manifest(path: Path, model: str, hint: str = "") -> PegainferError:
    """`model`: the arguments of the `pegainfer compile` that writes `path`; `hint`: another way, if any."""
    return PegainferError(f"no compiled kernels for this model at {path}: run `pegainfer compile {model}` first"
                          + (f" ({hint})" if hint else ""))
