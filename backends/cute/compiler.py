"""Ahead-of-time compilation of a CuTe DSL launch with no GPU: `cute.compile` of the template's @cute.jit host
function on fake tensors for the SM's architecture, keeping the PTX and cubin. The launch ABI is read from the
DSL's own output: the kernel's parameters from the PTX entry (a tensor of static layout is an 8-byte struct
holding its pointer), and grid, block and dynamic shared memory from the launch configuration its generated host
launcher fills in before cudaLaunchKernelEx."""

import glob
import importlib
import re
import tempfile
from importlib.metadata import version
from pathlib import Path

from pegainfer.backends.native import NativeLaunch, arch_name, cubin_resources
from pegainfer.backends.spec import GridDim, LaunchSpec, ParamKind
from pegainfer.errors import PegainferError

TEMPLATES = "pegainfer.backends.cute.kernels"
_CONFIG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"  # cudaLaunchConfig_t


def cute_version() -> str:
    return version("nvidia-cutlass-dsl")


def compile_to_files(launch: LaunchSpec, sm: int) -> tuple[str, bytes, str]:
    """(PTX, cubin, the host launcher's IR) of the launch for one SM."""
    import cutlass.cute as cute

    module = importlib.import_module(f"{TEMPLATES}.{Path(launch.module).stem}")
    function, fakes = getattr(module, launch.function)(**launch.constexprs)
    with tempfile.TemporaryDirectory(prefix="pegainfer-cute-") as folder:
        compiled = cute.compile(function, *fakes,
                                options=f"--gpu-arch={arch_name(sm)} --keep-ptx --keep-cubin --dump-dir={folder}")
        ptx_files, cubin_files = glob.glob(f"{folder}/*.ptx"), glob.glob(f"{folder}/*.cubin")
        if len(ptx_files) != 1 or len(cubin_files) != 1:
            raise PegainferError(f"{launch.function}: expected one PTX and one cubin from cute.compile, found "
                                 f"{len(ptx_files)} and {len(cubin_files)}")
        return Path(ptx_files[0]).read_text(), Path(cubin_files[0]).read_bytes(), str(compiled.ir_module)


def compile_launch(launch: LaunchSpec, sm: int) -> NativeLaunch:
    ptx, cubin, host_ir = compile_to_files(launch, sm)
    symbol, entry = ptx_entry(ptx)
    config = launch_config(host_ir)
    if config["block"][1:] != [1, 1]:
        raise PegainferError(f"{launch.function}: block {config['block']}; the runtime launches x only")
    for axis, (dim, theirs) in enumerate(zip(launch.grid, config["grid"])):
        if not all(isinstance(f, int) for f in dim.factors) or GridDim.size(dim, {}) != theirs:
            raise PegainferError(f"{launch.function}: grid axis {axis} is {theirs} in the DSL's launcher, the plan "
                                 f"says {dim}")
    abi = launch_abi(launch, entry)
    return NativeLaunch(symbol, cubin, {"ptx": ptx, "py": launch.source}, config["shared"], config["block"][0], abi,
                        cute_version(), cubin_resources(cubin))


def ptx_entry(ptx: str) -> tuple[str, list[tuple[str, int]]]:
    """(kernel symbol, [(param type, bytes)]) of the PTX's one .entry: ('struct', 8) or ('u32', 4)..."""
    entries = re.findall(r"\.entry\s+(\S+)\s*\((.*?)\)", ptx, re.S)
    if len(entries) != 1:
        raise PegainferError(f"expected one kernel entry in the PTX, found {len(entries)}")
    symbol, body = entries[0]
    params = []
    for line in filter(None, (part.strip() for part in body.split(","))):
        struct = re.search(r"\.b8\s+\S+\[(\d+)\]", line)
        scalar = re.search(r"\.param\s+\.([us]\d+|f32|b\d+)\s", line)
        if struct:
            params.append(("struct", int(struct.group(1))))
        elif scalar:
            params.append((scalar.group(1), int(re.sub(r"\D", "", scalar.group(1))) // 8))
        else:
            raise PegainferError(f"unrecognised PTX parameter: {line}")
    return symbol, params


def launch_abi(launch: LaunchSpec, entry: list[tuple[str, int]]) -> list[dict]:
    """The plan's parameters (the kernel's signature order) checked against the PTX entry, one for one."""
    if len(entry) != len(launch.params):
        raise PegainferError(f"{launch.function}: the PTX entry has {len(entry)} parameters, the plan "
                             f"{len(launch.params)}")
    abi = []
    for param, (kind, size) in zip(launch.params, entry):
        if param.kind is ParamKind.TENSOR and (kind, size) != ("struct", 8):
            raise PegainferError(f"{launch.function}: tensor {param.name} is a {size}-byte {kind} in the PTX; "
                                 f"only static layouts (an 8-byte pointer struct) are launched")
        if param.kind.is_int and (kind, size) not in (("u32", 4), ("s32", 4), ("b32", 4)):
            raise PegainferError(f"{launch.function}: int {param.name} is a {size}-byte {kind} in the PTX")
        abi.append({"name": param.name, "kind": str(param.kind), "value": param.value, "dtype": param.dtype})
    return abi


def launch_config(host_ir: str) -> dict:
    """Grid, block and dynamic shared memory that the DSL's host launcher stores into its cudaLaunchConfig_t."""
    launchers = [body for body in host_ir.split("llvm.func ") if f"x {_CONFIG}" in body]
    config = re.search(rf"(%\d+) = llvm\.alloca %\d+ x {re.escape(_CONFIG)}", launchers[0]) if launchers else None
    if config is None or len(launchers) != 1:
        raise PegainferError("the host launcher fills no cudaLaunchConfig_t: cannot read its launch shape")
    host_ir = launchers[0]  # SSA names are per function: read the launcher alone
    constants = dict(re.findall(r"(%\d+) = llvm\.mlir\.constant\((-?\d+) : i(?:32|64)\)", host_ir))
    fields = {}
    pattern = rf"(%\d+) = llvm\.getelementptr {re.escape(config.group(1))}\[0, (\d)(?:, (\d))?\]"
    for address, field, index in re.findall(pattern, host_ir):
        stored = re.search(rf"llvm\.store (%\d+), {re.escape(address)} :", host_ir)
        if stored and stored.group(1) in constants:
            fields[(int(field), int(index or 0))] = int(constants[stored.group(1)])
    try:
        return {"grid": [fields[(0, i)] for i in range(3)], "block": [fields[(1, i)] for i in range(3)],
                "shared": fields[(2, 0)]}
    except KeyError as missing:
        raise PegainferError(f"the host launcher's launch configuration lacks field {missing}") from None
