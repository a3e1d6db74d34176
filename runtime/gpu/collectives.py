"""The collective nodes of a rank's kernel DAG on the GPU: NCCL's calls (through a communicator, runtime/gpu/nccl.py)
queued on the engine's stream between the kernels' launches, so that CUDA graphs capture them with the rest. NCCL
gathers and scatters whole buffers along the leading axis; an all_gather along the last axis (the logits' parts of
the vocabulary) lands as [world, rows, part] in a buffer of its own and is laid out as [rows, world * part] by one
2D copy per rank (cuMemcpy2DAsync: a strided copy needs no kernel, and is captured like one)."""

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from typing import Protocol

from pegainfer.backends.cache import parallel_layout
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import DType
from pegainfer.ir.graph import Graph, Node
from pegainfer.passes.kernels import is_collective
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.memory import Arena, aligned


class Communicator(Protocol):
    """One rank's end of NCCL: each call queues a collective on `stream`. Counts are elements: all_gather's and
    reduce_scatter's are one rank's part, all_to_all's what goes to each peer."""
    world: int
    rank: int

    def all_reduce(self, src: int, dst: int, count: int, dtype: DType, stream) -> None: ...

    def all_gather(self, src: int, dst: int, count: int, dtype: DType, stream) -> None: ...

    def reduce_scatter(self, src: int, dst: int, count: int, dtype: DType, stream) -> None: ...

    def all_to_all(self, src: int, dst: int, count: int, dtype: DType, stream) -> None: ...


@dataclass(frozen=True)
class Strided:
    """One 2D copy: `rows` rows of `width` bytes, from `src` every `src_pitch` bytes to `dst` every `dst_pitch`."""
    dst: int
    dst_pitch: int
    src: int
    src_pitch: int
    width: int
    rows: int


def collective_nodes(graph: Graph) -> list[tuple[Graph, Node]]:
    return [(g, n) for g in graph.all_graphs() for n in g.nodes if is_collective(n)]


def check_collectives(graph: Graph, communicator: Communicator | None) -> None:
    """Refuses, before anything is uploaded, a rank's graph with no communicator or one of another world, and a
    collective whose layout NCCL does not take."""
    nodes = collective_nodes(graph)
    if not nodes:
        return
    world = nodes[0][1].attrs["world"]
    if communicator is None:
        raise PegainferError(f"{graph.name} is one rank's graph of {world} ({len(nodes)} collective nodes): the GPU "
                             f"engine needs a communicator (runtime/gpu/nccl.py) to run it")
    layout = parallel_layout(graph)
    if communicator.world != world or layout[1] not in (None, communicator.rank):
        raise PegainferError(f"{graph.name} is rank {layout[1]}'s graph of {world} ranks; the communicator is rank "
                             f"{communicator.rank} of {communicator.world}")
    for g, node in nodes:
        axis = node.attrs.get("axis", 0) % node.output_types[0].rank
        if node.op == "reduce_scatter" and axis != 0:
            raise PegainferError(f"{g.name}: %{node.name} scatters along axis {axis}; NCCL's reduce_scatter "
                                 f"splits the leading axis (axis 0)")


def landing_types(g: Graph, node: Node) -> tuple[int, ...] | None:
    """The [world, rows, part] shape (symbols left) an all_gather along a later axis lands in; None for the rest."""
    if node.op != "all_gather" or node.attrs["axis"] % node.output_types[0].rank == 0:
        return None
    source = g.value_types()[node.inputs[0]]
    return (node.attrs["world"], *source.shape)


def relayout(landing: DeviceTensor, out: DeviceTensor, world: int) -> list[Strided]:
    """The 2D copies that lay [world, rows, part] out as [rows, world * part] (out's rows may be wider: a view)."""
    rows, part = landing.shape[1], prod(landing.shape[2:])
    size = landing.dtype.itemsize
    return [Strided(out.ptr + r * part * size, out.row_stride * size, landing.ptr + r * rows * part * size,
                    part * size, part * size, rows) for r in range(world)]


def copy_2d(copy: Strided, stream) -> None:
    """cuMemcpy2DAsync, device to device, on the stream (a memcpy node when captured)."""
    from cuda.bindings import driver as cu

    params = cu.CUDA_MEMCPY2D()
    params.srcMemoryType = params.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    params.srcDevice, params.srcPitch = copy.src, copy.src_pitch
    params.dstDevice, params.dstPitch = copy.dst, copy.dst_pitch
    params.WidthInBytes, params.Height = copy.width, copy.rows
    driver.check(cu.cuMemcpy2DAsync(params, stream), "cuMemcpy2DAsync")


class Collectives:
    """Runs a rank's collective nodes: NCCL's call for each, with the landing buffers the gathers need."""

    def __init__(self, graph: Graph, communicator: Communicator | None, sizes: dict[str, int], stream,
                 copy: Callable[[Strided, object], None] = copy_2d) -> None:
        check_collectives(graph, communicator)
        self.communicator, self.stream, self.copy = communicator, stream, copy
        shapes = {(g.name, n.name): (shape, n.output_types[0].dtype) for g, n in collective_nodes(graph)
                  if (shape := landing_types(g, n)) is not None}
        concrete = {key: (tuple(d if isinstance(d, int) else sizes[d] for d in shape), dtype)
                    for key, (shape, dtype) in shapes.items()}
        arena = Arena(sum(aligned(prod(s) * t.itemsize) for s, t in concrete.values()), "gather") if shapes else None
        self.landing = {key: DeviceTensor.contiguous(arena.take(prod(s) * t.itemsize), s, t)
                        for key, (s, t) in concrete.items()}

    def run(self, graph: str, node: Node, source: DeviceTensor, out: DeviceTensor) -> None:
        """Queues the node's collective from `source` (this rank's part) into `out`."""
        comm, dtype = self.communicator, source.dtype
        count = prod(source.shape)
        landing = self.landing.get((graph, node.name))
        for name, tensor in (("input", source), *((("output", out),) if landing is None else ())):
            if len(tensor.shape) > 1 and tensor.row_stride != prod(tensor.shape[1:]):
                raise PegainferError(f"%{node.name} ({node.op}): its {name} is a strided view; NCCL reads and "
                                     f"writes whole buffers")
        if node.op == "all_reduce":
            comm.all_reduce(source.ptr, out.ptr, count, dtype, self.stream)
        elif node.op == "reduce_scatter":
            comm.reduce_scatter(source.ptr, out.ptr, count // comm.world, dtype, self.stream)
        elif node.op == "all_to_all":
            comm.all_to_all(source.ptr, out.ptr, count // comm.world, dtype, self.stream)
        elif landing is not None:
            landing = DeviceTensor.contiguous(landing.ptr, (comm.world, *source.shape), dtype)  # this step's rows
            comm.all_gather(source.ptr, landing.ptr, count, dtype, self.stream)
            for copy in relayout(landing, out, comm.world):
                self.copy(copy, self.stream)
        else:
            comm.all_gather(source.ptr, out.ptr, count, dtype, self.stream)
