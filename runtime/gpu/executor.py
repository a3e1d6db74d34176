"""Runs a lowered model graph on the GPU: the manifest's cubins over device buffers laid out by the memory plan.
Walks the graph as the reference interpreter does: views are pointer arithmetic, kernels are launches of the
variant for the step's row count, a repeated body runs once per layer with that layer's weights and KV cache."""

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path

import numpy as np

from pegainfer.backends.cache import sha256_of
from pegainfer.backends.manifest import Kernel, Launch, check_lowering, load
from pegainfer.backends.spec import ParamKind, first_serving, planes_of, runtime_order
from pegainfer.errors import PegainferError
from pegainfer.ir.graph import KERNEL, REPEAT, Graph, instantiate
from pegainfer.ir.kernel import in_place_outputs
from pegainfer.ir.step import PENALTY_ENTRIES, SLOT_POOL, launch_sizes, mask_words
from pegainfer.ir.types import TensorType
from pegainfer.passes.kernels import is_collective
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu import downloads
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.collectives import Collectives, Communicator, check_collectives
from pegainfer.runtime.gpu.launch import launch_kernel, load_function, programmatic
from pegainfer.runtime.gpu.memory import ALIGN, Arena, aligned
from pegainfer.runtime.gpu.planes import DeferredSums
from pegainfer.runtime.gpu.staging import PinnedPair
from pegainfer.runtime.gpu.upload import params_bytes, upload_weights

# Programmatic dependent launch (kernels compiled for sm_90 and later) for steps of at most this many tokens: the
# decode tiles were chosen launched so (docs/BENCHMARKS.md); larger steps launch every kernel plainly.
PDL_MAX_TOKENS = 16
TAIL_KINDS = ("lm_head_tail", "sampler_tail")  # the kernel that draws the tokens (fusion.py's plan_sampler_tail)


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # tokens in one step
    max_batch: int  # sequences in one step, and rows of logits
    max_blocks_per_seq: int
    num_blocks: int
    block_size: int
    mask_words: int = 1  # words of a grammar bitmask row: the logits' width over 32 (the executor sets it)
    penalties: int = PENALTY_ENTRIES  # penalty entries of one step (rows past them are drawn on the host)
    state_slots: int = 0  # rows of each recurrent state pool (a model with recurrent layers)
    max_samples: int = 0  # rows of logits one step draws, where more than a row a sequence (speculation); 0: batch

    @property
    def samples(self) -> int:
        return self.max_samples or self.max_batch

    def sizes(self) -> dict[str, int]:
        return {"tokens": self.max_tokens, "batch": self.max_batch, "samples": self.samples, "masks": self.samples,
                "mask_words": self.mask_words, "max_blocks": self.max_blocks_per_seq, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "max_query_len": self.max_tokens, "penalties": self.penalties,
                SLOT_POOL: self.state_slots}


class GpuExecutor:
    def __init__(self, ctx: driver.Context, graph: Graph, manifest_path: Path, weights: Mapping[str, np.ndarray],
                 limits: Limits, communicator: Communicator | None = None,
                 borrowed: Mapping[str, int] | None = None) -> None:
        """`weights`: the checkpoint's tensors (lazily read is best), derived params assembled on the device;
        `borrowed`: params another executor holds, by address (upload.shared_params); `communicator`: a sharded
        model's rank's, for its collective nodes (runtime/gpu/nccl.py)."""
        check_collectives(graph, communicator)
        logits = graph.value_types()[graph.outputs[0]]
        self.ctx, self.graph, self.limits = ctx, graph, replace(limits, mask_words=mask_words(logits.shape[-1]))
        manifest = load(manifest_path)
        check_lowering(manifest, manifest_path, graph)
        if manifest.block_size != limits.block_size:
            raise PegainferError(f"{manifest_path}: compiled for KV blocks of {manifest.block_size} tokens, "
                                 f"asked for {limits.block_size}")
        self.kernels = {(k.graph, k.node): k for k in manifest.kernels}
        # what a step's walk asks of every kernel node of every layer, computed once
        self.orders = {key: runtime_order(k.variants) for key, k in self.kernels.items()}
        self.in_place = {(g.name, n.name): in_place_outputs(n) for g in graph.all_graphs() for n in g.nodes
                         if n.op == KERNEL}
        self.types = {g.name: g.value_types() for g in graph.all_graphs()}
        self.bound: dict[tuple[str, int | None], dict[str, DeviceTensor]] = {}
        self._before_tail: Callable[[], None] | None = None
        self.functions = self._load_functions(manifest_path.parent.parent)
        borrowed = borrowed or {}
        arena = Arena(params_bytes(graph, borrowed) + ALIGN * len(graph.expanded_params()), "weights")
        self.weights = upload_weights(graph, weights, ctx.stream, arena, skip=borrowed) | dict(borrowed)
        sizes = self.limits.sizes()
        self.buffers, self.scratch, self.planes = self._allocate_activations(sizes)
        self.collectives = Collectives(graph, communicator, sizes, ctx.stream)
        self.sums = DeferredSums()
        for tensors in self.scratch.values():  # split GEMMs count on zeroed partial sums and tickets
            for t in tensors.values():
                driver.memset(t.ptr, prod(t.shape) * t.dtype.itemsize, ctx.stream)
        self.states: dict[str, DeviceTensor] = {}  # the KV cache: allocate_kv, once the engine knows its size
        self.pools: dict[str, DeviceTensor] = {}  # recurrent state pools: allocate_state_pools
        self.tables = self._allocate_tables()  # states of fixed shape the runtime fills (LoRA tables), zeroed
        self.profile: list[tuple[str, driver.Event, driver.Event]] | None = None  # set to a list to time launches
        self.pdl_max_tokens = PDL_MAX_TOKENS  # programmatic dependent launch up to this many tokens (0: never)
        self.inputs, self.stagings, self.input_region = self._allocate_inputs(sizes)
        self.landings = PinnedPair((1 << 20) + 1024 * self.limits.samples)  # fetch_later's: a step's tokens

    def kv_bytes_per_block(self) -> int:
        one = {"num_blocks": 1, "block_size": self.limits.block_size}
        return sum(aligned(_nbytes(t, one)) for t in self._states(pooled=False).values())

    def _allocate_tables(self) -> dict[str, DeviceTensor]:
        tables = {name: t for name, t in self.graph.expanded_states().items() if _fixed(t)}
        if not tables:
            return {}
        arena = Arena(sum(aligned(_nbytes(t, {})) for t in tables.values()), "tables")
        allocated = {name: DeviceTensor.contiguous(arena.take(_nbytes(t, {})), t.shape, t.dtype)
                     for name, t in tables.items()}
        driver.memset(arena.base, arena.size, self.ctx.stream)
        return allocated

    def write_row(self, name: str, row: int, array: np.ndarray) -> None:
        """Row `row` (the first dim) of a table state, from the host, queued on the step's stream."""
        table = self.tables[name]
        data = np.ascontiguousarray(array, dtype=table.dtype.np_dtype)
        size = prod(table.shape[1:]) * table.dtype.itemsize
        assert data.nbytes == size, f"{name}: a row of {size} bytes, given {data.nbytes}"
        driver.copy_to_device(table.ptr + row * size, data.view(np.uint8).reshape(-1), self.ctx.stream)

    def allocate_state_pools(self, slots: int) -> None:
        """The recurrent layers' state pools, `slots` rows each, zeroed: before the KV cache takes what is left."""
        assert not self.states, "state pools come before the KV cache"
        self.limits = replace(self.limits, state_slots=slots)
        pools = self._states(pooled=True)
        sizes = {SLOT_POOL: slots}
        arena = Arena(sum(aligned(_nbytes(t, sizes)) for t in pools.values()), "recurrent state")
        self.pools = {name: DeviceTensor.contiguous(arena.take(_nbytes(t, sizes)), t.concrete(sizes), t.dtype)
                      for name, t in pools.items()}
        driver.memset(arena.base, arena.size, self.ctx.stream)

    def copy_state_row(self, src: int, dst: int) -> None:
        """Row `src` of every recurrent state pool onto row `dst`, queued on the step's stream."""
        for pool in self.pools.values():
            row = pool.row_stride * pool.dtype.itemsize
            driver.copy_on_device(pool.ptr + dst * row, pool.ptr + src * row, row, self.ctx.stream)

    def allocate_kv(self, num_blocks: int) -> None:
        """The paged KV cache (every paged state of the graph) for `num_blocks` blocks, zeroed."""
        assert not self.states, "the KV cache is allocated once"
        self.bound.clear()  # layers bound before, without their cache
        self.limits = replace(self.limits, num_blocks=num_blocks)
        sizes = self.limits.sizes()
        arena = Arena(self.kv_bytes_per_block() * num_blocks, "KV cache")
        self.states = {name: DeviceTensor.contiguous(arena.take(_nbytes(t, sizes)), t.concrete(sizes), t.dtype)
                       for name, t in self._states(pooled=False).items()} | self.pools | self.tables
        driver.memset(arena.base, arena.size, self.ctx.stream)

    def share_kv(self, other: "GpuExecutor") -> None:
        """`other`'s KV cache as this one's (two graphs of one draft head, of the same layers, take turns on it)."""
        mine = self._states(pooled=False)
        assert not self.states and mine == other._states(pooled=False), "a KV cache shared once, of the same states"
        self.limits = replace(self.limits, num_blocks=other.limits.num_blocks)
        self.states = {name: other.states[name] for name in mine} | self.pools | self.tables

    def paged_states(self) -> list[str]:
        """The KV cache's states by expanded name (what the host tier copies a block of)."""
        return list(self._states(pooled=False))

    def _states(self, pooled: bool) -> dict[str, TensorType]:
        """The graph's paged states (KV caches), or its pools of per-sequence rows (tables of fixed shape apart)."""
        return {name: t for name, t in self.graph.expanded_states().items()
                if (t.shape[0] == SLOT_POOL) == pooled and not _fixed(t)}

    def _load_functions(self, folder: Path) -> dict[str, tuple]:
        functions = {}
        for launch in (launch for k in self.kernels.values() for v in k.variants for launch in v.launches):
            cubin = (folder / launch.cubin).read_bytes()
            if sha256_of(cubin) != launch.sha256:
                raise PegainferError(f"{folder / launch.cubin}: sha256 differs from the manifest; run pegainfer "
                                     f"compile again")
            functions[launch.key] = load_function(cubin, launch)
        return functions

    def _allocate_activations(self, sizes: dict[str, int]) -> tuple[dict, dict, dict]:
        """From one pool: (graph, buffer) -> device pointers (one, or two for a body's carry buffers, alternated
        by layer), each kernel's scratch tensors, and two copies of a split GEMM's planes (alternated by layer)."""
        need: dict[tuple[str, str], int] = {}
        for g in self.graph.all_graphs():
            types = g.value_types()
            for value, buffer in g.buffers.items():
                need[(g.name, buffer)] = max(need.get((g.name, buffer), 0), _nbytes(types[value], sizes))
        copies = {key: 2 if key[1].startswith("carry") else 1 for key in need}
        own = {key: _own_planes(kernel) for key, kernel in self.kernels.items()}
        scratch_types = {key: {n: t for n, t in k.scratch.items() if n not in own[key]}
                         for key, k in self.kernels.items() if k.scratch}
        plane_types = {key: {n: t for n, t in k.scratch.items() if n in own[key]}
                       for key, k in self.kernels.items() if k.scratch}
        total = sum(aligned(n) * copies[key] for key, n in need.items())
        total += sum(aligned(_nbytes(t, sizes)) * (2 if name in own[key] else 1)
                     for key, k in self.kernels.items() for name, t in k.scratch.items())
        arena = Arena(total, "activations")
        buffers = {key: [arena.take(n) for _ in range(copies[key])] for key, n in need.items()}

        def take(types: dict[str, TensorType]) -> dict[str, DeviceTensor]:
            return {name: DeviceTensor.contiguous(arena.take(_nbytes(t, sizes)), t.concrete(sizes), t.dtype)
                    for name, t in types.items()}
        scratch = {key: take(types) for key, types in scratch_types.items()}
        planes = {key: [take(types), take(types)] for key, types in plane_types.items() if types}
        return buffers, scratch, planes

    def _allocate_inputs(self, sizes: dict[str, int]):
        """One device region and one pinned host region hold every step input, so a step uploads once."""
        layout, offset = {}, 0
        for name, t in self.graph.inputs.items():
            layout[name], offset = (offset, t), offset + -(-_nbytes(t, sizes) // 256) * 256
        region = driver.alloc(offset)
        return layout, PinnedPair(offset), region

    def upload_step(self, step: dict[str, np.ndarray]) -> dict[str, int]:
        """Copies the step's inputs up in one transfer; returns the step's sizes."""
        sizes = {"num_blocks": self.limits.num_blocks, "block_size": self.limits.block_size,
                 "max_blocks": self.limits.max_blocks_per_seq, SLOT_POOL: self.limits.state_slots}
        arrays = {}
        for name, (offset, t) in self.inputs.items():
            array = np.ascontiguousarray(step[name], dtype=t.dtype.np_dtype)
            if name == "block_tables":  # fixed width, so the row stride never changes (CUDA graphs)
                padded = np.zeros((array.shape[0], self.limits.max_blocks_per_seq), dtype=array.dtype)
                padded[:, : array.shape[1]] = array
                array = padded
            sizes.update({d: s for d, s in zip(t.shape, array.shape) if isinstance(d, str)})
            arrays[offset] = array
        sizes |= launch_sizes(step["query_lens"])
        self._check(sizes)  # before the staging is written: a step past the limits would not fit it
        staging = self.stagings.take()
        for offset, array in arrays.items():
            staging[offset: offset + array.nbytes] = array.view(np.uint8).reshape(-1)
        end = max(offset + array.nbytes for offset, array in arrays.items())
        driver.copy_to_device(self.input_region, staging[:end], self.ctx.stream)
        self.stagings.queued(self.ctx.stream)
        return sizes

    def upload_inputs(self, arrays: dict[str, np.ndarray]) -> None:
        """Some step inputs again, queued after what the stream holds (a step's grammar masks, filled late); each
        must fit the step's layout (the bitmask's rows may grow, up to the limits)."""
        staging = self.stagings.current  # the step's own area: its other inputs are uploaded already
        for name, array in arrays.items():
            offset, t = self.inputs[name]
            data = np.ascontiguousarray(array, dtype=t.dtype.np_dtype).view(np.uint8).reshape(-1)
            staging[offset: offset + data.size] = data
            driver.copy_to_device(self.input_region + offset, staging[offset: offset + data.size], self.ctx.stream)
        self.stagings.queued(self.ctx.stream)

    def _check(self, sizes: dict[str, int]) -> None:
        limits = self.limits
        for name, limit in (("tokens", limits.max_tokens), ("batch", limits.max_batch), ("samples", limits.samples)):
            if sizes[name] > limit:
                raise PegainferError(f"a step of {sizes[name]} {name} exceeds this engine's {limit}")

    def run(self, sizes: dict[str, int], before_tail: Callable[[], None] | None = None,
            skip: frozenset[str] = frozenset()) -> dict[str, DeviceTensor]:
        """Launches the whole graph for the uploaded step on the stream; returns its outputs (on the device).
        `before_tail` is called once every kernel before the sampler tail is launched: the host fills the step's
        grammar masks while the GPU runs the layers, and uploads them (upload_inputs) ahead of the tail. Kernels
        of the kinds in `skip`, each writing its outputs in place, are left out: their inputs are their results."""
        self._before_tail, self._skip = before_tail, skip
        env = {name: DeviceTensor.contiguous(self.input_region + offset, t.concrete(sizes), t.dtype)
               for name, (offset, t) in self.inputs.items()}
        env["block_tables"] = DeviceTensor(env["block_tables"].ptr, env["block_tables"].shape,
                                           env["block_tables"].dtype, self.limits.max_blocks_per_seq)
        self.sums = DeferredSums()
        outputs = self._run(self.graph, env, sizes, None)
        for run in self.sums.flush(outputs):
            self._run_launch(*run)
        return dict(zip(self.graph.outputs, outputs))

    def _run(self, g: Graph, env: dict[str, DeviceTensor], sizes: dict[str, int], layer: int | None) -> list:
        at = (lambda name: name) if layer is None else (lambda name: instantiate(name, layer))
        types = self.types[g.name]
        bound = self.bound.get((g.name, layer))
        if bound is None:  # a layer's weights and KV cache as tensors, once
            bound = self.bound[(g.name, layer)] = {
                **{name: DeviceTensor.contiguous(self.weights[at(name)], t.shape, t.dtype)
                   for name, t in g.params.items()}, **{name: self.states[at(name)] for name in g.states}}
        env.update(bound)
        for node in g.nodes:
            if node.op == REPEAT:
                body = self.graph.subgraphs[node.attrs["body"]]
                values = [env[v] for v in node.inputs]
                carried, invariant = values[: len(body.outputs)], values[len(body.outputs):]
                for index in range(node.attrs["count"]):
                    body_env = dict(zip(body.inputs, [*carried, *invariant]))
                    carried = self._run(body, body_env, sizes, index)
                env.update(zip(node.outputs, carried))
            elif node.op == KERNEL:
                if node.attrs["kind"] in TAIL_KINDS and self._before_tail is not None:
                    self._before_tail()
                key = (g.name, node.name)
                in_place = self.in_place[key]
                for out in node.outputs:
                    env[out] = env[in_place[out]] if out in in_place else self._buffer(g, out, types[out], sizes, layer)
                if node.attrs["kind"] in self._skip and set(node.outputs) <= set(in_place):
                    continue  # its inputs, written in place, are its results
                self.sums.written([env[out] for out in node.outputs if out not in in_place])
                self._launch(key, env | self._scratch(g.name, node.name, layer), sizes)
            elif is_collective(node):
                self._collective(g, node, env, sizes, layer)
            elif node.op == "reshape":
                source = env[node.inputs[0]]
                env[node.outputs[0]] = source.reshape(types[node.outputs[0]].concrete(sizes))
            elif node.op == "split":
                source, start = env[node.inputs[0]], 0
                for out, width in zip(node.outputs, node.attrs["sizes"]):
                    env[out] = source.columns(start, width)
                    start += width
            else:
                raise AssertionError(f"node %{node.name} ({node.op}) is neither a kernel nor a view")
        return [env[name] for name in g.outputs]

    def _collective(self, g: Graph, node, env: dict[str, DeviceTensor], sizes: dict[str, int],
                    layer: int | None) -> None:
        """NCCL's call for the node, on the stream after every launch so far; a deferred sum of its input (a split
        GEMM's planes) run first."""
        source = env[node.inputs[0]]
        out = env[node.outputs[0]] = self._buffer(g, node.outputs[0], node.output_types[0], sizes, layer)
        for run in self.sums.before_reading([source]):
            self._run_launch(*run)
        self.sums.written([out])
        with self._timed(f"{node.op}/nccl"):
            self.collectives.run(g.name, node, source, out)

    def _buffer(self, g: Graph, value: str, type_: TensorType, sizes: dict[str, int],
                layer: int | None) -> DeviceTensor:
        pointers = self.buffers[(g.name, g.buffers[value])]
        ptr = pointers[(layer or 0) % len(pointers)]
        return DeviceTensor.contiguous(ptr, type_.concrete(sizes), type_.dtype)

    def _scratch(self, graph: str, node: str, layer: int | None) -> dict[str, DeviceTensor]:
        """A kernel's scratch; a split GEMM's planes alternate by layer, as carry buffers do, so that the planes of
        a layer's output, summed later, outlive the next layer's GEMM."""
        planes = self.planes.get((graph, node), [{}])
        return self.scratch.get((graph, node), {}) | planes[(layer or 0) % len(planes)]

    def _launch(self, key: tuple[str, str], env: dict[str, DeviceTensor], sizes: dict[str, int]) -> None:
        """The variant's launches; a deferred one (a split GEMM's sum) recorded instead, and run once a launch
        reads its output other than through its planes (see runtime/gpu/planes.py)."""
        kernel = self.kernels[key]
        variant = first_serving(kernel, self.orders[key], sizes)
        for run in self.sums.schedule(variant.launches, env, sizes, f"{kernel.kind}/{variant.name}"):
            self._run_launch(*run)

    def _run_launch(self, origin: str, launch: Launch, env: dict[str, DeviceTensor], sizes: dict[str, int]) -> None:
        """One launch; `origin` (kernel kind / variant) labels it in a profile."""
        _, function = self.functions[launch.key]
        with self._timed(f"{origin}/{launch.symbol}"):
            launch_kernel(function, launch, env, sizes, self.ctx.stream,  # the driver copies the arguments
                          pdl=programmatic(launch, sizes, self.pdl_max_tokens))

    @contextmanager
    def _timed(self, label: str) -> Iterator[None]:
        """Events around what the block queues, into the profile where one is kept."""
        if self.profile is None:
            yield
            return
        events = (driver.Event(), driver.Event())
        events[0].record(self.ctx.stream)
        yield
        events[1].record(self.ctx.stream)
        self.profile.append((label, *events))

    def fetch_later(self, tensors: list[DeviceTensor]) -> Callable[[], list[np.ndarray]]:
        return downloads.fetch_later(self.ctx, self.landings, tensors)

    def fetch(self, tensor: DeviceTensor) -> np.ndarray:
        return downloads.fetch(self.ctx, tensor)


def _fixed(t: TensorType) -> bool:
    """A state of fixed shape (a LoRA table), which the runtime fills: neither paged nor pooled."""
    return all(isinstance(d, int) for d in t.shape)


def _own_planes(kernel: Kernel) -> set[str]:
    """The kernel's scratch that holds planes its split GEMMs write (alternated by layer, see _scratch)."""
    return {planes_of(p.value) for v in kernel.variants for launch in v.launches for p in launch.params
            if p.kind is ParamKind.PLANES} & set(kernel.scratch)


def _nbytes(t: TensorType, sizes: dict[str, int]) -> int:
    return t.dtype.itemsize * prod(t.concrete(sizes))


