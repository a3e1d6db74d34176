"""Launching any backend's cubin by its manifest record: Triton's (pointers, ints, trailing scratch pointers),
TileLang's (TMA descriptors by value, dynamic shared memory past 48 KB with static shared memory on top) and CuTe
DSL's (a static-layout tensor is an 8-byte struct holding its pointer). Argument packing is pure Python and tested
on the CPU."""

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from pegainfer.backends.manifest import Launch
from pegainfer.backends.spec import Param, ParamKind
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.tma import TENSOR_MAP_BYTES, Encoder, encode_tiled, resolve


class LaunchArguments:
    """ctypes storage for each argument (TMA descriptors 64-byte aligned) and the kernelParams pointer array."""

    def __init__(self) -> None:
        self.values: list = []
        self.addresses: list[int] = []

    def scalar(self, value: ctypes._SimpleCData) -> None:
        self.values.append(value)
        self.addresses.append(ctypes.addressof(value))

    def finish(self) -> "LaunchArguments":
        self.pointers = (ctypes.c_void_p * max(len(self.addresses), 1))(*self.addresses)
        return self

    @property
    def address(self) -> int:
        return ctypes.addressof(self.pointers)


def pack_launch(params: Sequence[Param], tensors: dict[str, DeviceTensor], sizes: dict[str, int],
                scratch: dict[str, int] | None = None, encode: Encoder = encode_tiled) -> LaunchArguments:
    """The kernel's arguments in ABI order: 8-byte pointers, 128-byte descriptors, i32 sizes and strides."""
    args = LaunchArguments()
    for param in params:
        kind = param.kind
        if kind in (ParamKind.TENSOR, ParamKind.PLANES):
            args.scalar(ctypes.c_uint64(_pointer(param, tensors[param.buffer], sizes)))
        elif kind is ParamKind.SCRATCH:
            args.scalar(ctypes.c_uint64((scratch or {}).get(param.name, 0)))
        elif kind is ParamKind.TMA:
            storage, address = _blobs(encode).get(param, tensors[param.buffer].ptr, sizes)
            args.values.append(storage)
            args.addresses.append(address)
        else:  # an i32
            number = _integer(param, tensors, sizes)
            assert -2**31 <= number < 2**31, f"{param.name}={number} does not fit an i32 parameter"
            args.scalar(ctypes.c_int32(number))
    return args.finish()


class DescriptorBlobs:
    """Encoded descriptors in 64-byte aligned storage, kept per (parameter, address, the step sizes its dims name):
    a prefill step passes some 400 descriptors, nearly all of them the last step's, and resolving, checking and
    copying each one again cost more than its launch."""

    def __init__(self, encode: Encoder, capacity: int = 8192) -> None:
        self.encode, self.capacity = encode, capacity
        self.blobs: dict[tuple, tuple[Param, ctypes.Array, int]] = {}

    def get(self, param: Param, address: int, sizes: dict[str, int]) -> tuple[ctypes.Array, int]:
        tma = param.tma
        key = (id(param), address, *(sizes.get(d) for d in (*tma.dims, *tma.strides) if isinstance(d, str)))
        hit = self.blobs.get(key)
        if hit is None or hit[0] is not param:  # an id outlives its object only if the parameter was dropped
            data = self.encode(resolve(tma, address, sizes))
            assert len(data) == TENSOR_MAP_BYTES, f"{param.name}: a CUtensorMap is 128 bytes, got {len(data)}"
            storage = (ctypes.c_uint8 * (TENSOR_MAP_BYTES + 64))()
            aligned = -(-ctypes.addressof(storage) // 64) * 64
            ctypes.memmove(aligned, data, TENSOR_MAP_BYTES)
            if len(self.blobs) >= self.capacity:
                self.blobs.clear()
            hit = self.blobs[key] = (param, storage, aligned)
        return hit[1], hit[2]


_BLOBS: dict[int, tuple[Encoder, DescriptorBlobs]] = {}


def _blobs(encode: Encoder) -> DescriptorBlobs:
    entry = _BLOBS.get(id(encode))
    if entry is None or entry[0] is not encode:
        entry = _BLOBS[id(encode)] = (encode, DescriptorBlobs(encode))
    return entry[1]


def _pointer(param: Param, tensor: DeviceTensor, sizes: dict[str, int]) -> int:
    """The tensor's pointer, or `param.skip` rows into it (a launch over the step's later sequences only)."""
    if param.skip is None:
        return tensor.ptr
    return tensor.ptr + sizes[param.skip] * tensor.row_stride * tensor.dtype.itemsize


def _integer(param: Param, tensors: dict[str, DeviceTensor], sizes: dict[str, int]) -> int:
    if param.kind is ParamKind.STRIDE:
        return tensors[param.buffer].row_stride
    if param.kind in (ParamKind.ROWS, ParamKind.PLANE_ROWS):
        return tensors[param.buffer].shape[0]
    return sizes[param.value]  # DIM


@dataclass(frozen=True)
class LaunchShape:
    grid: tuple[int, int, int]
    threads: int
    shared: int  # dynamic shared memory, bytes


def shape_of(launch: Launch, sizes: dict[str, int]) -> LaunchShape:
    """The launch's grid for this step, by the rule the manifest records, its block and its shared memory."""
    return LaunchShape(tuple(dim.size(sizes) for dim in launch.grid), launch.threads, launch.shared)


def load_function(cubin: bytes, launch: Launch):
    """cuModuleLoadData + cuModuleGetFunction, and the dynamic shared memory allowance set whenever the launch asks
    for any: past 48 KB the driver needs it, counting the kernel's static shared memory too (TileLang's GEMMs ask
    for exactly 48 KB dynamic on top of 1 KB static)."""
    from cuda.bindings import driver as cuda

    symbol = launch.symbol
    module = driver.check(cuda.cuModuleLoadData(cubin), f"cuModuleLoadData({symbol})")
    function = driver.check(cuda.cuModuleGetFunction(module, symbol.encode()), f"cuModuleGetFunction({symbol})")
    if launch.shared > 0:
        attribute = cuda.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.check(cuda.cuFuncSetAttribute(function, attribute, launch.shared), f"cuFuncSetAttribute({symbol})")
    return module, function


def programmatic(launch: Launch, sizes: dict[str, int], max_tokens: int) -> bool:
    """Whether a launch goes with programmatic dependent launch: its kernel opted in (the manifest's `pdl`) and the
    step has at most `max_tokens` tokens, as the runtime and `pegainfer tune` both decide it."""
    return launch.pdl and sizes["tokens"] <= max_tokens


def launch_kernel(function, launch: Launch, tensors: dict[str, DeviceTensor], sizes: dict[str, int], stream,
                  scratch: dict[str, int] | None = None, *, pdl: bool = False) -> LaunchArguments:
    """Packs and launches (`pdl`: programmatic dependent launch, for a kernel compiled to wait on its predecessor);
    returns the arguments, which must outlive the call only until it returns."""
    args = pack_launch(launch.params, tensors, sizes, scratch)
    shape = shape_of(launch, sizes)
    driver.launch(function, launch.symbol, shape.grid, shape.threads, shape.shared, stream, args.address,
                  pdl=pdl, cluster=launch.cluster)
    return args
