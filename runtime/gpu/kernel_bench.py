"""Running one kernel's launches alone on the GPU, on buffers of the model's real shapes: what `pegainfer tune`
times each candidate with. Buffers get random values; the step inputs (block tables, sequence starts...) come
from a synthetic step packed as the engine packs real ones, so attention reads valid blocks."""

from collections.abc import Callable
from itertools import count
from math import prod

import numpy as np

from pegainfer.backends.manifest import Kernel, Launch, Variant
from pegainfer.backends.spec import ParamKind, planes_of, serves
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import Graph
from pegainfer.ir.step import TOKEN_MASK_INDEX
from pegainfer.ir.types import TensorType
from pegainfer.runtime.batch import Chunk, Sequence, pack_step
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.launch import launch_kernel, load_function, programmatic
from pegainfer.runtime.kv_blocks import BlockAllocator

_RANDOM = (np.random.default_rng(0).standard_normal(1 << 22) * 0.5).astype(np.float32)


def synthetic_step(batch: int, query_len: int, context: int, block_size: int) -> tuple[dict, dict[str, int]]:
    """(step inputs, sizes) of `batch` sequences each bringing `query_len` tokens to a context of `context`."""
    blocks_per_seq = -(-context // block_size)
    allocator = BlockAllocator(batch * blocks_per_seq + 1, block_size)
    chunks = []
    for index in range(batch):
        seq = Sequence(index, [1] * context, num_cached=context - query_len)
        allocator.grow(seq.table, context - query_len)
        chunks.append(Chunk(seq, query_len))
    step = pack_step(chunks, allocator) | {TOKEN_MASK_INDEX: np.full(batch, -1, np.int32)}  # no grammar masks
    sizes = {"tokens": batch * query_len, "batch": batch, "samples": batch, "masks": 1, "penalties": 1,
             "max_query_len": query_len, "num_blocks": batch * blocks_per_seq + 1, "block_size": block_size,
             "max_blocks": step["block_tables"].shape[1]}
    return step, sizes


def weight_names(lowered: Graph, kernel: Kernel) -> frozenset[str]:
    """The kernel's graph's parameters (weights): what a decode step streams from memory."""
    return frozenset(next(g for g in lowered.all_graphs() if g.name == kernel.graph).params)


def kernel_types(lowered: Graph, kernel: Kernel) -> dict[str, TensorType]:
    """Every buffer a kernel's launches may name: its graph's values, its inner nodes' outputs, its scratch."""
    graph = next(g for g in lowered.all_graphs() if g.name == kernel.graph)
    node = next(n for n in graph.nodes if n.name == kernel.node)
    types = graph.value_types() | {o: t for n in node.attrs["nodes"] for o, t in zip(n.outputs, n.output_types)}
    types |= kernel.candidate_scratch
    # a norm launch's planes of its X2, which it reads when a split GEMM left them: none here (it reads X2)
    read = {p.value for v in kernel.candidates for launch in v.launches for p in launch.params
            if p.kind is ParamKind.PLANES}
    return types | {planes_of(value): TensorType(dtype_from_name("f32"), (0, types[value].shape[-1]))
                    for value in read if planes_of(value) not in types}


def step_launches(variant: Variant) -> list[Launch]:
    """What a step runs of the variant where the kernels after it read its output as it leaves it: a deferred
    launch (a split GEMM's sum of planes, which the norm launch after o_proj and down adds itself) left out."""
    return [launch for launch in variant.launches if not launch.deferred]


class Buffers:
    """Device memory for named values, made once per (value, bytes) and reused across candidates."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.allocated: dict[tuple[str, int], int] = {}

    def env(self, names: set[str], types: dict[str, TensorType], sizes: dict[str, int], step: dict,
            zeroed: frozenset[str] = frozenset(), copy: int = 0, copied: frozenset[str] = frozenset()) -> dict:
        """`zeroed`: values that start as zeros (scratch: a split GEMM's partial sums and tickets), not random.
        `copied`: values that get buffers of their own per `copy` index (weights, streamed from memory by a decode
        step: timings cycle through copies so that the L2 does not hold them)."""
        env = {}
        for name in names:
            t = types[name]
            shape = t.concrete(sizes)
            if name == "block_tables":
                shape = step[name].shape
            nbytes = max(1, prod(shape) * t.dtype.itemsize)
            key = (name, nbytes, copy if name in copied else 0)
            if key not in self.allocated:
                self.allocated[key] = driver.alloc(nbytes)
                host = step[name] if name in step else \
                    np.zeros(shape) if name in zeroed else _random(t, shape)
                driver.copy_to_device(self.allocated[key], np.ascontiguousarray(host, dtype=t.dtype.np_dtype))
            env[name] = DeviceTensor.contiguous(self.allocated[key], shape, t.dtype)
        return env


def _random(t: TensorType, shape: tuple[int, ...]) -> np.ndarray:
    if t.dtype.is_float:
        return np.resize(_RANDOM, shape).astype(t.dtype.np_dtype)
    return np.zeros(shape, dtype=t.dtype.np_dtype)


def launch_values(launches: list[Launch]) -> set[str]:
    """The buffers the launches read pointers, descriptors, strides or rows of."""
    return {p.buffer for launch in launches for p in launch.params if p.buffer is not None}


def time_launches(ctx: driver.Context, folder, launches: list[Launch], env: dict | list[dict], sizes: dict[str, int],
                  repeats: int = 20, functions: dict | None = None, copies: int = 4, pdl_max_tokens: int = 0) -> float:
    """Microseconds of one run of the launches on the device alone (graph_seconds); a list of envs is cycled
    through, one a run. Launches that opt in are launched programmatically at up to `pdl_max_tokens` tokens, as the
    runtime launches them (a decode tile chosen for that launch was 5% slower launched plainly)."""
    functions = {} if functions is None else functions
    for launch in launches:
        if launch.key not in functions:
            functions[launch.key] = load_function((folder / launch.cubin).read_bytes(), launch)[1]
    envs = env if isinstance(env, list) else [env]
    runs = count()

    def run() -> None:  # called `copies` times, while the graph is captured
        current = envs[next(runs) % len(envs)]
        for launch in launches:
            launch_kernel(functions[launch.key], launch, current, sizes, ctx.stream,
                          pdl=programmatic(launch, sizes, pdl_max_tokens))
    return graph_seconds(ctx, run, copies, repeats) * 1e6


def graph_seconds(ctx: driver.Context, run: Callable[[], object], copies: int = 4, repeats: int = 20) -> float:
    """Seconds of one `run` (its launches on ctx's stream) on the device alone: `copies` runs captured in a CUDA
    graph (as a decode step runs), replayed `repeats` times between two events after a warm-up replay. Timing
    launches from the host would count their argument packing (TMA descriptors are encoded per launch) as device
    time."""
    with driver.Graph(ctx.stream) as graph:
        for _ in range(copies):
            run()
    graph.replay()
    ctx.synchronize()
    start, end = driver.Event(), driver.Event()
    start.record(ctx.stream)
    for _ in range(repeats):
        graph.replay()
    end.record(ctx.stream)
    ctx.synchronize()
    return end.seconds_since(start) / (repeats * copies)


def serving_variant(kernel: Kernel, sizes: dict[str, int], backend: str = "triton") -> Variant:
    """The first of a backend's candidates that serves these sizes, conditional slots left out: what a step
    falls through to when a conditional slot is not chosen."""
    for variant in kernel.candidates:
        if variant.backend == backend and not variant.min_sizes and serves(variant, kernel.row_symbol, sizes):
            return variant
    raise AssertionError(f"kernel {kernel.node}: no {backend} variant serves {sizes}")
