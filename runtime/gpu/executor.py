"""Runs a lowered model graph on the GPU: the manifest's cubins over device buffers laid out by the memory plan.
Walks the graph as the reference interpreter does: views are pointer arithmetic, kernels are launches of the
variant for the step's row count, a repeated body runs once per layer with that layer's weights and KV cache."""

import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from pegainfer.backends.cache import sha256_of
from pegainfer.backends.spec import fits
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import KERNEL, REPEAT, Graph, instantiate
from pegainfer.ir.kernel import in_place_outputs
from pegainfer.ir.types import TensorType
from pegainfer.progress import Progress
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.abi import DeviceTensor, grid_of, pack_arguments


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # tokens in one step
    max_batch: int  # sequences in one step, and rows of logits
    max_blocks_per_seq: int
    num_blocks: int
    block_size: int

    def sizes(self) -> dict[str, int]:
        return {"tokens": self.max_tokens, "batch": self.max_batch, "samples": self.max_batch,
                "max_blocks": self.max_blocks_per_seq, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "max_query_len": self.max_tokens}


class GpuExecutor:
    def __init__(self, ctx: driver.Context, graph: Graph, manifest_path: Path, weights: Mapping[str, np.ndarray],
                 limits: Limits) -> None:
        """`weights` holds the checkpoint's tensors (read lazily is best); derived params are assembled on the
        device from their sources, one host tensor at a time."""
        self.ctx, self.graph, self.limits = ctx, graph, limits
        manifest = json.loads(manifest_path.read_text())
        if manifest["block_size"] != limits.block_size:
            raise PegainferError(f"{manifest_path}: compiled for KV blocks of {manifest['block_size']} tokens, "
                                 f"asked for {limits.block_size}")
        self.kernels = {(k["graph"], k["node"]): k for k in manifest["kernels"]}
        self.functions = self._load_functions(manifest_path.parent.parent)
        self.weights = self._upload_weights(graph, weights)
        sizes = limits.sizes()
        self.states = {name: DeviceTensor.contiguous(driver.alloc(_nbytes(t, sizes)), t.concrete(sizes), t.dtype)
                       for name, t in graph.expanded_states().items()}
        for state in self.states.values():
            driver.memset(state.ptr, prod(state.shape) * state.dtype.itemsize, ctx.stream)
        self.buffers = self._allocate_buffers(sizes)
        self.scratch = {key: {name: DeviceTensor.contiguous(driver.alloc(_nbytes(t, sizes)), t.concrete(sizes), t.dtype)
                              for name, t in _scratch_types(kernel).items()}
                        for key, kernel in self.kernels.items() if kernel.get("scratch")}
        self.profile: list[tuple[str, driver.Event, driver.Event]] | None = None  # set to a list to time launches
        self.inputs, self.staging, self.input_region = self._allocate_inputs(sizes)
        self.download = driver.alloc_pinned(1 << 20)  # fetch_all's landing area

    def _load_functions(self, folder: Path) -> dict[str, tuple]:
        functions = {}
        for kernel in self.kernels.values():
            for variant in kernel["variants"]:
                for launch in variant["launches"]:
                    cubin = (folder / launch["cubin"]).read_bytes()
                    if sha256_of(cubin) != launch["sha256"]:
                        raise PegainferError(f"{folder / launch['cubin']}: sha256 differs from the manifest; "
                                             f"run pegainfer compile again")
                    functions[launch["key"]] = driver.load_function(cubin, launch["symbol"], launch["shared"])
        return functions

    def _upload_weights(self, graph: Graph, weights: Mapping[str, np.ndarray]) -> dict[str, int]:
        """One tensor at a time (a progress bar, and the load rate in GB/s at the end, on stderr)."""
        derivations = graph.derivations()
        params = graph.expanded_params()
        progress = Progress("loading weights", len(params))
        started, total = time.perf_counter(), 0
        uploaded = {}
        for name, t in params.items():
            ptr = driver.alloc(t.dtype.itemsize * prod(t.shape))
            offset = 0
            assert name not in derivations or derivations[name].axis == 0, f"{name}: only row concatenation"
            for source in derivations[name].sources if name in derivations else (name,):
                array = np.ascontiguousarray(weights[source])  # concatenation along rows: consecutive bytes
                driver.copy_to_device(ptr + offset, array)
                offset += array.nbytes
            uploaded[name] = ptr
            total += offset
            progress.advance()
        seconds = time.perf_counter() - started
        print(f"pegainfer: loaded {total / 1e9:.2f} GB of weights in {seconds:.1f} s "
              f"({total / 1e9 / max(seconds, 1e-9):.2f} GB/s)", file=sys.stderr)
        return uploaded

    def _allocate_buffers(self, sizes: dict[str, int]) -> dict[tuple[str, str], list[int]]:
        """(graph, buffer) -> device pointers: one, or two for a body's carry buffers (alternated by layer)."""
        allocated: dict[tuple[str, str], list[int]] = {}
        for g in self.graph.all_graphs():
            types = g.value_types()
            need: dict[str, int] = {}
            for value, buffer in g.buffers.items():
                need[buffer] = max(need.get(buffer, 0), _nbytes(types[value], sizes))
            for buffer, nbytes in need.items():
                copies = 2 if buffer.startswith("carry") else 1
                allocated[(g.name, buffer)] = [driver.alloc(nbytes) for _ in range(copies)]
        return allocated

    def _allocate_inputs(self, sizes: dict[str, int]):
        """One device region and one pinned host region hold every step input, so a step uploads once."""
        layout, offset = {}, 0
        for name, t in self.graph.inputs.items():
            layout[name] = (offset, t)
            offset += -(-_nbytes(t, sizes) // 256) * 256
        region = driver.alloc(offset)
        staging = driver.alloc_pinned(offset)
        return layout, staging, region

    def upload_step(self, step: dict[str, np.ndarray]) -> dict[str, int]:
        """Copies the step's inputs up in one transfer; returns the step's sizes."""
        sizes = {"num_blocks": self.limits.num_blocks, "block_size": self.limits.block_size,
                 "max_blocks": self.limits.max_blocks_per_seq}
        end = 0
        for name, (offset, t) in self.inputs.items():
            array = np.ascontiguousarray(step[name], dtype=t.dtype.np_dtype)
            if name == "block_tables":  # fixed width, so the row stride never changes (CUDA graphs)
                padded = np.zeros((array.shape[0], self.limits.max_blocks_per_seq), dtype=array.dtype)
                padded[:, : array.shape[1]] = array
                array = padded
            sizes.update({d: s for d, s in zip(t.shape, array.shape) if isinstance(d, str)})
            self.staging[offset: offset + array.nbytes] = array.view(np.uint8).reshape(-1)
            end = max(end, offset + array.nbytes)
        sizes["max_query_len"] = int(step["query_lens"].max())
        self._check(sizes)
        driver.copy_to_device(self.input_region, self.staging[:end], self.ctx.stream)
        return sizes

    def _check(self, sizes: dict[str, int]) -> None:
        for name, limit in (("tokens", self.limits.max_tokens), ("batch", self.limits.max_batch),
                            ("samples", self.limits.max_batch)):
            if sizes[name] > limit:
                raise PegainferError(f"a step of {sizes[name]} {name} exceeds this engine's {limit}")

    def run(self, sizes: dict[str, int]) -> dict[str, DeviceTensor]:
        """Launches the whole graph for the uploaded step on the stream; returns its outputs (on the device)."""
        env = {name: DeviceTensor.contiguous(self.input_region + offset, t.concrete(sizes), t.dtype)
               for name, (offset, t) in self.inputs.items()}
        env["block_tables"] = DeviceTensor(env["block_tables"].ptr, env["block_tables"].shape,
                                           env["block_tables"].dtype, self.limits.max_blocks_per_seq)
        outputs = self._run(self.graph, env, sizes, None)
        return dict(zip(self.graph.outputs, outputs))

    def _run(self, g: Graph, env: dict[str, DeviceTensor], sizes: dict[str, int], layer: int | None) -> list:
        at = (lambda name: name) if layer is None else (lambda name: instantiate(name, layer))
        types = g.value_types()
        env.update({name: DeviceTensor.contiguous(self.weights[at(name)], t.shape, t.dtype)
                    for name, t in g.params.items()})
        env.update({name: self.states[at(name)] for name in g.states})
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
                in_place = in_place_outputs(node)
                for out in node.outputs:
                    env[out] = env[in_place[out]] if out in in_place else self._buffer(g, out, types[out], sizes, layer)
                self._launch(self.kernels[(g.name, node.name)], env | self.scratch.get((g.name, node.name), {}), sizes)
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

    def _buffer(self, g: Graph, value: str, type_: TensorType, sizes: dict[str, int],
                layer: int | None) -> DeviceTensor:
        pointers = self.buffers[(g.name, g.buffers[value])]
        ptr = pointers[(layer or 0) % len(pointers)]
        return DeviceTensor.contiguous(ptr, type_.concrete(sizes), type_.dtype)

    def _launch(self, kernel: dict, env: dict[str, DeviceTensor], sizes: dict[str, int]) -> None:
        rows = sizes[kernel["row_symbol"]]
        variant = next(v for v in kernel["variants"] if fits(v["max_rows"], rows))
        for launch in variant["launches"]:
            _, function = self.functions[launch["key"]]
            args = pack_arguments(launch["params"], env, sizes)  # the driver copies them at the call
            if self.profile is not None:
                events = (driver.Event(), driver.Event())
                events[0].record(self.ctx.stream)
            driver.launch(function, launch["symbol"], grid_of(launch, sizes), 32 * launch["num_warps"],
                          launch["shared"], self.ctx.stream, args.address)
            if self.profile is not None:
                events[1].record(self.ctx.stream)
                self.profile.append((f"{kernel['kind']}/{variant['name']}/{launch['symbol']}", *events))

    def fetch_all(self, tensors: list[DeviceTensor]) -> list[np.ndarray]:
        """Small contiguous tensors (a step's sampled tokens) in one round trip: each copied into pinned memory
        on the stream, one synchronisation."""
        sizes = [prod(t.shape) * t.dtype.itemsize for t in tensors]
        if sum(sizes) + 256 * len(sizes) > self.download.nbytes:
            return [self.fetch(t) for t in tensors]
        offsets = [sum(-(-n // 256) * 256 for n in sizes[:i]) for i in range(len(sizes))]
        for tensor, offset, nbytes in zip(tensors, offsets, sizes):
            assert tensor.row_stride == prod(tensor.shape[1:]), "fetch_all reads contiguous tensors"
            driver.copy_to_host(self.download[offset: offset + nbytes], tensor.ptr, self.ctx.stream)
        self.ctx.synchronize()
        return [self.download[o: o + n].view(t.dtype.np_dtype).reshape(t.shape).copy()
                for t, o, n in zip(tensors, offsets, sizes)]

    def fetch(self, tensor: DeviceTensor) -> np.ndarray:
        host = np.empty(tensor.shape, dtype=tensor.dtype.np_dtype)
        assert tensor.row_stride == prod(tensor.shape[1:]), "fetch reads contiguous tensors"
        driver.copy_to_host(host, tensor.ptr, self.ctx.stream)
        self.ctx.synchronize()
        return host


def _scratch_types(kernel: dict) -> dict[str, TensorType]:
    return {name: TensorType(dtype_from_name(dtype), tuple(shape)) for name, (dtype, shape) in kernel["scratch"].items()}


def _nbytes(t: TensorType, sizes: dict[str, int]) -> int:
    return t.dtype.itemsize * prod(t.concrete(sizes))


