"""Ahead-of-time compilation of a TileLang launch with no GPU: the template's prim_func lowered to CUDA inside a
TVM target context, nvcc to a cubin, and the launch ABI read from the lowered modules: the device function's
parameters in order (pointers, TMA descriptors, dynamic sizes), its thread extents and dynamic shared memory, and
the host module's TMA descriptor arguments, which the runtime encodes with cuTensorMapEncodeTiled."""

import importlib
from importlib.metadata import version
from pathlib import Path

from pegainfer.backends.native import NativeLaunch, arch_name, compile_cuda
from pegainfer.backends.spec import GridDim, LaunchSpec
from pegainfer.errors import PegainferError

TEMPLATES = "pegainfer.backends.tilelang.kernels"
SAMPLE_SIZES = (1, 17, 128, 1000, 8192)  # row counts at which the plan's grid rule must equal TileLang's


def tilelang_version() -> str:
    return version("tilelang")


def build_prim_func(launch: LaunchSpec):
    module = importlib.import_module(f"{TEMPLATES}.{Path(launch.module).stem}")
    return getattr(module, launch.function)(**launch.constexprs)


def lower(launch: LaunchSpec, sm: int):
    """(prim_func, TileLang's compiled artifact: host module, device module, CUDA source)."""
    import tilelang
    from tilelang import tvm

    func = build_prim_func(launch)
    with tvm.target.Target({"kind": "cuda", "arch": arch_name(sm)}):
        return func, tilelang.lower(func)


def compile_launch(launch: LaunchSpec, sm: int) -> NativeLaunch:
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    func, artifact = lower(launch, sm)
    (symbol, device), = [(gv.name_hint, f) for gv, f in artifact.device_mod.functions.items()]
    abi = launch_abi(launch, func, device, _tma_args(artifact))
    threads = _check_launch_shape(launch, device)
    ptx, cubin, resources = compile_cuda(artifact.kernel_source, sm, [TILELANG_TEMPLATE_PATH, CUTLASS_INCLUDE_DIR],
                                         symbol)
    shared = int(device.attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in device.attrs else 0
    # TileLang leaves a cluster to the launch (its host stub asks cudaLaunchKernelEx for it), not to the cubin
    cluster = tuple(int(d) for d in device.attrs["cluster_dims"]) if "cluster_dims" in device.attrs else (1, 1, 1)
    return NativeLaunch(symbol, cubin, {"ptx": ptx, "cu": artifact.kernel_source, "py": launch.source}, shared,
                        threads, abi, tilelang_version(), resources, cluster)


def _tma_args(artifact) -> dict:
    (host,) = artifact.host_mod.functions.values()
    return dict(host.attrs["tma_descriptor_args"]) if "tma_descriptor_args" in host.attrs else {}


def launch_abi(launch: LaunchSpec, func, device, tma_args: dict) -> list[dict]:
    """The device function's parameters in TileLang's order, each tied to the plan's parameter of that buffer."""
    by_name = {p.name: p for p in launch.params}
    buffers = {b.data.name: b.name for b in func.buffer_map.values()}
    symbols = {p.name: p.value for p in launch.params if p.kind.is_int}
    descriptors = {str(var.name): args for var, args in tma_args.items()}
    abi = []
    for param in device.params:
        name = str(param.name)
        if name in descriptors:
            args = descriptors[name]
            buffer = buffers[str(args[4].name)]
            abi.append({"name": name, "kind": "tma", "value": by_name[buffer].value, "dtype": "tma",
                        "tma": _descriptor(args, symbols, name)})
        elif name in buffers:
            planned = by_name[buffers[name]]
            abi.append({"name": name, "kind": str(planned.kind), "value": planned.value, "dtype": planned.dtype}
                       | ({"skip": planned.skip} if planned.skip else {}))
        elif name in by_name and by_name[name].kind.is_int and str(param.dtype) == "int32":
            abi.append({"name": name, "kind": str(by_name[name].kind), "value": by_name[name].value,
                        "dtype": "i32"})
        else:
            raise PegainferError(f"{launch.function}: kernel parameter {name} ({param.dtype}) has no planned value")
    return abi


def _descriptor(args, symbols: dict[str, str], name: str) -> dict:
    """tma_descriptor_args: (tag, var, dtype, rank, tensor, dims[rank], strides[rank] in bytes with the element
    size first, box[rank], element strides[rank], interleave, swizzle, L2 promotion, OOB fill); dims innermost
    first. A dim that is a dynamic size is recorded by its step symbol."""
    from tvm import tirx

    if args[0].value != "__tvm_tensormap_create_tiled":
        raise PegainferError(f"{name}: only tiled TMA descriptors are supported, found {args[0].value}")
    rank = int(args[3])
    fields = list(args[5:])

    def value(expr):
        if isinstance(expr, tirx.IntImm):
            return int(expr)
        if isinstance(expr, tirx.Var) and str(expr.name) in symbols:
            return symbols[str(expr.name)]
        raise PegainferError(f"{name}: descriptor field {expr} is neither a constant nor a planned size")

    take = lambda start: [value(e) for e in fields[start * rank:(start + 1) * rank]]  # noqa: E731
    tail = [int(e) for e in fields[4 * rank:]]
    return {"dtype": int(args[2]), "rank": rank, "dims": take(0), "strides": take(1), "box": take(2),
            "element_strides": take(3), "interleave": tail[0], "swizzle": tail[1], "l2_promotion": tail[2],
            "oob_fill": tail[3]}


def _check_launch_shape(launch: LaunchSpec, device) -> int:
    """The plan's grid rule must give TileLang's grid at every sample size; the block must be one-dimensional."""
    from tilelang import tvm
    from tvm import tirx

    extents = {str(k): v for k, v in device.attrs["thread_extent"].items()}
    if int(extents.get("threadIdx.y", 1)) != 1 or int(extents.get("threadIdx.z", 1)) != 1:
        raise PegainferError(f"{launch.function}: a block of {extents} threads; the runtime launches x only")
    variables = {str(v.name): v for e in extents.values() for v in tirx.analysis.undefined_vars(e)}
    symbols = {p.name: p.value for p in launch.params if p.kind.is_int}
    analyzer = tvm.arith.Analyzer()
    for rows in SAMPLE_SIZES:
        sizes = {symbols[name]: rows for name in variables}
        for axis, dim in zip("xyz", launch.grid):
            expr = extents.get(f"blockIdx.{axis}", tirx.IntImm("int32", 1))
            bound = {variables[name]: tirx.IntImm("int32", rows) for name in variables}
            theirs = int(analyzer.simplify(tirx.stmt_functor.substitute(expr, bound)))
            ours = GridDim.size(dim, sizes)
            if theirs != ours:
                raise PegainferError(f"{launch.function}: grid.{axis} is {theirs} in TileLang's lowering but the "
                                     f"plan's rule {dim} gives {ours} at {sizes}")
    return int(extents["threadIdx.x"])


def host_stub(launch: LaunchSpec, sm: int) -> str:
    """TileLang's own generated host launcher (C++) for this launch: what its JIT would compile and call. Used by
    the tests to check the manifest's ABI against TileLang's, not by the build."""
    from tilelang import tvm
    from tilelang.jit.adapter.wrapper import TLCUDASourceWrapper

    func, artifact = lower(launch, sm)
    target = tvm.target.Target({"kind": "cuda", "arch": arch_name(sm)})
    wrapper = TLCUDASourceWrapper(tvm.IRModule({launch.function: func}), artifact.kernel_source, target,
                                  artifact.device_mod, artifact.host_mod)
    return wrapper.lib_code[len(artifact.kernel_source):]
