"""Runs a kernel DAG with its planned Triton launches under Triton's CPU interpreter (torch tensors on the CPU).
It walks the graph exactly as the GPU runtime will: views are views, kernels are launches of the planned
variant with arguments packed by the parameter ABI; a collective node (a rank's graph of a sharded model) runs its
reference, the ranks as threads (ir/ranks.py), one launch interpreted at a time. Only the tests run it: it is how
every generated Triton kernel is checked against the reference interpreter with no GPU (DESIGN.md, correctness
layer 3)."""

import threading

import ml_dtypes
import numpy as np
import torch

from pegainfer.backends.spec import KernelSpec, LaunchSpec, Param, ParamKind, pick_variant
from pegainfer.backends.triton.loader import load_kernel_module, triton_interpret
from pegainfer.ir.graph import KERNEL, REPEAT, Graph, Node, instantiate
from pegainfer.ir.interpreter import execute
from pegainfer.ir.kernel import in_place_outputs
from pegainfer.ir.step import launch_sizes
from pegainfer.ir.types import TensorType
from pegainfer.passes.kernels import is_collective

_TORCH = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32,
          "i64": torch.int64}


_INTERPRETER = threading.Lock()  # the interpreter's state is global: ranks as threads launch one at a time
_FP8 = {np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn, np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2}


def _patch_float8_casts() -> None:
    """Triton 3.6's interpreter rounds float casts to float8 e4m3 ties up and loses the carry into the exponent
    (1.998 becomes 1.0); the GPU rounds to nearest even and saturates (cvt.rn.satfinite). Casts to e4m3 go through
    ml_dtypes instead, as the GPU rounds; every other cast is the interpreter's own."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "pegainfer_exact_float8", False):
        return
    floats = {tl.float32: np.float32, tl.float16: np.float16, tl.bfloat16: ml_dtypes.bfloat16}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype != tl.float8e4nv or input_dtype not in floats:
            return original(data, input_dtype, output_dtype, rounding_mode)
        values = np.asarray(data).view(floats[input_dtype]).astype(np.float32)
        return np.clip(values, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)

    convert.pegainfer_exact_float8 = True
    interpreter._convert_float = convert


_patch_float8_casts()


def to_torch(array: np.ndarray) -> torch.Tensor:
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    if array.dtype in _FP8:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(_FP8[array.dtype])
    return torch.from_numpy(np.ascontiguousarray(array))


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()


class InterpretedExecutor:
    def __init__(self, graph: Graph, specs: dict[tuple[str, str], KernelSpec]) -> None:
        self.graph = graph
        self.specs = specs

    def run(self, inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray],
            states: dict[str, torch.Tensor]) -> list[np.ndarray]:
        sizes = step_sizes(self.graph, inputs, states)
        args = [to_torch(inputs[name]) for name in self.graph.inputs]
        return [to_numpy(t) for t in self._run(self.graph, args, weights, states, sizes, None)]

    def _run(self, graph: Graph, args: list[torch.Tensor], weights, states, sizes, layer) -> list[torch.Tensor]:
        at = (lambda name: name) if layer is None else (lambda name: instantiate(name, layer))
        env = dict(zip(graph.inputs, args))
        env.update({name: to_torch(weights[at(name)]) for name in graph.params})
        env.update({name: states[at(name)] for name in graph.states})
        for node in graph.nodes:
            if node.op == REPEAT:
                body = self.graph.subgraphs[node.attrs["body"]]
                values = [env[v] for v in node.inputs]
                carried = values[: len(body.outputs)]
                for index in range(node.attrs["count"]):
                    carried = self._run(body, [*carried, *values[len(body.outputs):]], weights, states, sizes, index)
                env.update(zip(node.outputs, carried))
            elif node.op == KERNEL:
                env.update(launch_kernel(self.specs[(graph.name, node.name)], node, env, sizes))
            elif is_collective(node):  # the ranks meet in its reference
                (result,) = execute(node, [to_numpy(env[node.inputs[0]])])
                env[node.outputs[0]] = to_torch(np.asarray(result))
            else:
                env.update(zip(node.outputs, _view(node, env[node.inputs[0]])))
        return [env[name] for name in graph.outputs]


def launch_kernel(spec: KernelSpec, node: Node, env: dict[str, torch.Tensor], sizes: dict[str, int], *,
                  module: str | None = None) -> dict[str, torch.Tensor]:
    """Runs one kernel node's planned launches on the tensors `env` names; returns its outputs. With `module`,
    only the launches of that template file run, on outputs `env` already holds (the sampler tail's launches on
    given logits, say)."""
    in_place = in_place_outputs(node)
    local = dict(env)
    for name, (dtype, shape) in spec.scratch.items():  # zeroed, as the GPU runtime does; or the caller's own
        if name not in env:
            local[name] = torch.zeros([d if isinstance(d, int) else sizes[d] for d in shape],
                                      dtype=_TORCH[dtype])
    for name, type_ in zip(node.outputs, node.output_types):
        if name in in_place:
            local[name] = env[in_place[name]]
        elif module is None or name not in env:
            local[name] = _poisoned(type_, sizes)
    for launch in pick_variant(spec, sizes).launches:
        if module is None or launch.module == module:
            _run_launch(launch, local, sizes)
    return {name: local[name] for name in node.outputs}


def _run_launch(launch: LaunchSpec, env: dict[str, torch.Tensor], sizes: dict[str, int]) -> None:
    with _INTERPRETER:
        _interpret(launch, env, sizes)


def _interpret(launch: LaunchSpec, env: dict[str, torch.Tensor], sizes: dict[str, int]) -> None:
    module = load_kernel_module(launch.source, launch.module, interpret=True)
    args = {param.name: _argument(param, env, sizes) for param in launch.params}
    grid = tuple(dim.size(sizes) for dim in launch.grid)
    constexprs = dict(launch.constexprs)
    if "UPCAST_DOT" in constexprs:
        constexprs["UPCAST_DOT"] = True  # the interpreter's bf16 tl.dot is wrong; see kernels/gemm.py
    function = getattr(module, launch.function)
    if "PDL" in function.arg_names:
        constexprs["PDL"] = False  # the interpreter runs launches one after another (and has no griddepcontrol)
    with triton_interpret(True):
        function[grid](**args, **constexprs)


def _argument(param: Param, env: dict[str, torch.Tensor], sizes: dict[str, int]) -> torch.Tensor | int:
    """What the GPU runtime passes for the parameter (runtime/gpu/launch.py), here from torch tensors."""
    if param.kind in (ParamKind.TENSOR, ParamKind.PLANES):
        return env[param.buffer][sizes[param.skip]:] if param.skip else env[param.buffer]
    if param.kind is ParamKind.STRIDE:
        return env[param.buffer].stride(0)
    if param.kind in (ParamKind.ROWS, ParamKind.PLANE_ROWS):
        return env[param.buffer].shape[0]
    if param.kind is ParamKind.DIM:
        return sizes[param.value]
    raise AssertionError(f"parameter {param.name}: no {param.kind} parameter runs under the interpreter")


def _poisoned(type_: TensorType, sizes: dict[str, int]) -> torch.Tensor:
    """A fresh output filled with NaN (or -1), so that an element the kernel forgot to write shows."""
    shape = type_.concrete(sizes)
    dtype = _TORCH[type_.dtype.name]
    return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype)


def _view(node: Node, source: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if node.op == "reshape":
        return (source.view([d if isinstance(d, int) else -1 for d in node.attrs["shape"]]),)
    if node.op == "split":
        return tuple(torch.split(source, list(node.attrs["sizes"]), dim=-1))
    raise AssertionError(f"node %{node.name} ({node.op}) is neither a kernel nor a view")


def step_sizes(graph: Graph, inputs: dict[str, np.ndarray], states: dict[str, torch.Tensor]) -> dict[str, int]:
    """Every symbol's size in this step, read off the inputs and the states, plus the launch-only sizes."""
    sizes: dict[str, int] = {}
    for name, type_ in graph.inputs.items():
        sizes.update({d: s for d, s in zip(type_.shape, np.shape(inputs[name])) if isinstance(d, str)})
    for name, type_ in graph.expanded_states().items():
        sizes.update({d: s for d, s in zip(type_.shape, states[name].shape) if isinstance(d, str)})
    return sizes | launch_sizes(inputs["query_lens"])
