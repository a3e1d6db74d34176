"""Launching any backend's cubin by its manifest record: Triton's (pointers, ints, trailing scratch pointers),
TileLang's (TMA descriptors by value, dynamic shared memory past 48 KB with static shared memory on top) and CuTe
DSL's (a static-layout tensor is an 8-byte struct holding its pointer). Argument packing is pure Python and tested
on the CPU; the executor calls `load_function` and `launch_kernel` in place of its Triton-only ones."""

import ctypes
from dataclasses import dataclass

from pegainfer.backends.spec import GridDim
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.tma import TENSOR_MAP_BYTES, Encoder, encode_memoized, resolve


class LaunchArguments:
    """ctypes storage for each argument (TMA descriptors 64-byte aligned) and the kernelParams pointer array."""

    def __init__(self) -> None:
        self.values: list = []
        self.addresses: list[int] = []

    def scalar(self, value: ctypes._SimpleCData) -> None:
        self.values.append(value)
        self.addresses.append(ctypes.addressof(value))

    def blob(self, data: bytes, align: int = 64) -> None:
        storage = (ctypes.c_uint8 * (len(data) + align))()
        address = -(-ctypes.addressof(storage) // align) * align
        ctypes.memmove(address, data, len(data))
        self.values.append(storage)
        self.addresses.append(address)

    def finish(self) -> "LaunchArguments":
        self.pointers = (ctypes.c_void_p * max(len(self.addresses), 1))(*self.addresses)
        return self

    @property
    def address(self) -> int:
        return ctypes.addressof(self.pointers)


def pack_launch(params: list[dict], tensors: dict[str, DeviceTensor], sizes: dict[str, int],
                scratch: dict[str, int] | None = None, encode: Encoder = encode_memoized) -> LaunchArguments:
    args = LaunchArguments()
    for param in params:
        kind, value = param["kind"], param["value"]
        if kind == "tensor":
            args.scalar(ctypes.c_uint64(tensors[value].ptr))
        elif kind == "scratch":
            args.scalar(ctypes.c_uint64((scratch or {}).get(param["name"], 0)))
        elif kind == "tma":
            data = encode(resolve(param["tma"], tensors[value].ptr, sizes))
            assert len(data) == TENSOR_MAP_BYTES, f"{param['name']}: a CUtensorMap is 128 bytes, got {len(data)}"
            args.blob(data)
        elif kind == "int":
            what, _, name = value.partition(":")  # stride:<value>, rows:<value> (its leading dim) or dim:<symbol>
            number = tensors[name].row_stride if what == "stride" else tensors[name].shape[0] if what == "rows" \
                else sizes[name]
            assert -2**31 <= number < 2**31, f"{param['name']}={number} does not fit an i32 parameter"
            args.scalar(ctypes.c_int32(number))
        else:
            raise AssertionError(f"parameter {param['name']}: unknown kind {kind!r}")
    return args.finish()


@dataclass(frozen=True)
class LaunchShape:
    grid: tuple[int, int, int]
    threads: int
    shared: int  # dynamic shared memory, bytes


def shape_of(launch: dict, sizes: dict[str, int]) -> LaunchShape:
    threads = launch.get("threads") or 32 * launch["num_warps"]
    return LaunchShape(tuple(GridDim.from_json(dim).size(sizes) for dim in launch["grid"]), threads, launch["shared"])


def load_function(cubin: bytes, launch: dict):
    """cuModuleLoadData + cuModuleGetFunction, and the dynamic shared memory allowance set whenever the launch asks
    for any: past 48 KB the driver needs it, counting the kernel's static shared memory too (TileLang's GEMMs ask
    for exactly 48 KB dynamic on top of 1 KB static)."""
    from cuda.bindings import driver as cuda

    symbol = launch["symbol"]
    module = driver.check(cuda.cuModuleLoadData(cubin), f"cuModuleLoadData({symbol})")
    function = driver.check(cuda.cuModuleGetFunction(module, symbol.encode()), f"cuModuleGetFunction({symbol})")
    if launch["shared"] > 0:
        attribute = cuda.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.check(cuda.cuFuncSetAttribute(function, attribute, launch["shared"]), f"cuFuncSetAttribute({symbol})")
    return module, function


def programmatic(launch: dict, sizes: dict[str, int], max_tokens: int) -> bool:
    """Whether a launch goes with programmatic dependent launch: its kernel opted in (the manifest's `pdl`) and the
    step has at most `max_tokens` tokens, as the runtime and `pegainfer tune` both decide it."""
    return launch.get("pdl", False) and sizes["tokens"] <= max_tokens


def launch_kernel(function, launch: dict, tensors: dict[str, DeviceTensor], sizes: dict[str, int], stream,
                  scratch: dict[str, int] | None = None, *, pdl: bool = False) -> LaunchArguments:
    """Packs and launches (`pdl`: programmatic dependent launch, for a kernel compiled to wait on its predecessor);
    returns the arguments, which must outlive the call only until it returns."""
    args = pack_launch(launch["params"], tensors, sizes, scratch)
    shape = shape_of(launch, sizes)
    driver.launch(function, launch["symbol"], shape.grid, shape.threads, shape.shared, stream, args.address,
                  pdl=pdl, cluster=tuple(launch.get("cluster") or (1, 1, 1)))
    return args
