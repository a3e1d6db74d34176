"""Thin, checked wrappers over cuda.bindings.driver. Every call's status is checked; a failure names the call
and, for launches, the kernel and its grid."""

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

from pegainfer.errors import PegainferError


class CudaError(PegainferError):
    pass


def _driver():
    from cuda.bindings import driver
    return driver


def check(result, what: str):
    """cuda.bindings returns (status, *values): raise on a bad status, return the values."""
    driver = _driver()
    status, *values = result if isinstance(result, tuple) else (result,)
    if status != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(status)
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


# Calls a step makes many of go through ctypes.PyDLL, which keeps the GIL over the call: cuda.bindings gives it up
# for every driver call, and a thread that gave it up waits up to the switch interval (5 ms) to get it back from a
# busy thread (the server's event loop), once per call. None of these blocks: they queue work on the stream.
_VOID, _UINT, _SIZE = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
_HELD_SIGNATURES = {
    "cuLaunchKernel": [_VOID, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _VOID, _VOID, _VOID],
    "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, _VOID, _SIZE, _VOID],
    "cuMemcpyDtoHAsync_v2": [_VOID, ctypes.c_uint64, _SIZE, _VOID],
    "cuGraphLaunch": [_VOID, _VOID],
}


@functools.cache
def _held(name: str):
    function = getattr(ctypes.PyDLL("libcuda.so.1"), name)
    function.argtypes, function.restype = _HELD_SIGNATURES[name], ctypes.c_int
    return function


def _check_held(status: int, what: str) -> None:
    if status:
        raise CudaError(f"{what} failed: {_driver().CUresult(status).name}")


@dataclass
class Context:
    device: int
    context: object
    stream: object

    @classmethod
    def create(cls, ordinal: int = 0) -> "Context":
        driver = _driver()
        check(driver.cuInit(0), "cuInit")
        device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        context = check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        stream = check(driver.cuStreamCreate(1), "cuStreamCreate")  # non-blocking
        return cls(ordinal, context, stream)

    def synchronize(self) -> None:
        check(_driver().cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def name(self) -> str:
        raw = check(_driver().cuDeviceGetName(256, self.device), "cuDeviceGetName")
        return raw.split(b"\0")[0].decode()


def alloc(nbytes: int) -> int:
    return int(check(_driver().cuMemAlloc(max(nbytes, 1)), f"cuMemAlloc({nbytes})"))


def free(ptr: int) -> None:
    check(_driver().cuMemFree(ptr), "cuMemFree")


def alloc_pinned(nbytes: int) -> np.ndarray:
    """Page-locked host memory as a uint8 array (freed with the process, or by free_pinned)."""
    ptr = int(check(_driver().cuMemHostAlloc(max(nbytes, 1), 0), f"cuMemHostAlloc({nbytes})"))
    return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))


def free_pinned(array: np.ndarray) -> None:
    """Returns memory from alloc_pinned; the array must not be used afterwards."""
    check(_driver().cuMemFreeHost(array.ctypes.data), "cuMemFreeHost")


def copy_to_device(dst: int, src: np.ndarray, stream=None) -> None:
    src = np.ascontiguousarray(src)
    if stream is None:
        check(_driver().cuMemcpyHtoD(dst, src.ctypes.data, src.nbytes), "cuMemcpyHtoD")
    else:
        _check_held(_held("cuMemcpyHtoDAsync_v2")(dst, src.ctypes.data, src.nbytes, int(stream)), "cuMemcpyHtoDAsync")


def copy_to_host(dst: np.ndarray, src: int, stream=None) -> np.ndarray:
    assert dst.flags.c_contiguous
    if stream is None:
        check(_driver().cuMemcpyDtoH(dst.ctypes.data, src, dst.nbytes), "cuMemcpyDtoH")
    else:
        _check_held(_held("cuMemcpyDtoHAsync_v2")(dst.ctypes.data, src, dst.nbytes, int(stream)), "cuMemcpyDtoHAsync")
    return dst


def copy_rows(host: np.ndarray, device: int, device_pitch: int, rows: int, to_host: bool, stream) -> None:
    """`rows` equal rows between contiguous host memory and device rows `device_pitch` bytes apart, in one
    cuMemcpy2DAsync (the host KV tier's block: a row per paged state)."""
    cu = _driver()
    assert host.flags.c_contiguous and host.nbytes % rows == 0, f"{host.nbytes} bytes in {rows} rows"
    params = cu.CUDA_MEMCPY2D()
    device_side, host_side = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE, cu.CUmemorytype.CU_MEMORYTYPE_HOST
    width = host.nbytes // rows
    if to_host:
        params.srcMemoryType, params.srcDevice, params.srcPitch = device_side, device, device_pitch
        params.dstMemoryType, params.dstHost, params.dstPitch = host_side, host.ctypes.data, width
    else:
        params.srcMemoryType, params.srcHost, params.srcPitch = host_side, host.ctypes.data, width
        params.dstMemoryType, params.dstDevice, params.dstPitch = device_side, device, device_pitch
    params.WidthInBytes, params.Height = width, rows
    check(cu.cuMemcpy2DAsync(params, stream), "cuMemcpy2DAsync")


def copy_on_device(dst: int, src: int, nbytes: int, stream) -> None:
    check(_driver().cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def memset(ptr: int, nbytes: int, stream) -> None:
    check(_driver().cuMemsetD8Async(ptr, 0, nbytes, stream), "cuMemsetD8Async")


def launch(function, symbol: str, grid: tuple[int, int, int], threads: int, shared: int, stream,
           params_address: int, *, pdl: bool = False, cluster: tuple[int, int, int] = (1, 1, 1)) -> None:
    """`params_address`: the address of an array of pointers to each argument's value (kernelParams). `pdl`:
    programmatic dependent launch, for a kernel that waits on its predecessor itself (griddepcontrol.wait): it may
    start while that one drains, which hides the launch gap between them. `cluster`: the thread block cluster's
    shape, for a kernel compiled to meet the other CTAs of its cluster (TileLang leaves it to the launch)."""
    shown = (", pdl" if pdl else "") + (f", cluster={cluster}" if cluster != (1, 1, 1) else "")
    what = f"cuLaunchKernel({symbol}, grid={grid}, block={threads}{shown})"
    if not pdl and cluster == (1, 1, 1):
        status = _held("cuLaunchKernel")(int(function), *grid, threads, 1, 1, shared, int(stream), params_address,
                                         None)
        _check_held(status, what)
        return
    driver = _driver()
    check(driver.cuLaunchKernelEx(_launch_config(grid, threads, shared, stream, pdl, cluster), function,
                                  params_address, 0), what)


def _launch_config(grid: tuple[int, int, int], threads: int, shared: int, stream, pdl: bool,
                   cluster: tuple[int, int, int]):
    driver = _driver()
    attributes = []
    if pdl:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        attributes.append(attribute)
    if cluster != (1, 1, 1):
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster
        attributes.append(attribute)
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = shared
    config.hStream = stream
    config.attrs = attributes
    config.numAttrs = len(attributes)
    return config


def device_memory() -> tuple[int, int]:
    """(free, total) bytes."""
    return check(_driver().cuMemGetInfo(), "cuMemGetInfo")


def new_stream():
    """A non-blocking stream of the current context (beside a context's own, for copies that overlap its steps)."""
    return check(_driver().cuStreamCreate(1), "cuStreamCreate")


class Event:
    def __init__(self, timing: bool = True) -> None:
        flags = 0 if timing else _driver().CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.event = check(_driver().cuEventCreate(flags), "cuEventCreate")

    def record(self, stream) -> None:
        check(_driver().cuEventRecord(self.event, stream), "cuEventRecord")

    def wait(self, stream) -> None:
        """Work queued on `stream` from now on starts after the work before this event's latest record."""
        check(_driver().cuStreamWaitEvent(stream, self.event, 0), "cuStreamWaitEvent")

    def synchronize(self) -> None:
        check(_driver().cuEventSynchronize(self.event), "cuEventSynchronize")

    def done(self) -> bool:
        """Whether the work before the event's record has finished (no wait)."""
        result = _driver().cuEventQuery(self.event)
        status = result[0] if isinstance(result, tuple) else result
        if status == _driver().CUresult.CUDA_ERROR_NOT_READY:
            return False
        check(result, "cuEventQuery")
        return True

    def seconds_since(self, start: "Event") -> float:
        return check(_driver().cuEventElapsedTime(start.event, self.event), "cuEventElapsedTime") / 1e3


class Graph:
    """A CUDA graph captured from the stream's launches, replayed with one call."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.exec = None

    def __enter__(self) -> "Graph":
        driver = _driver()
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(self.stream, mode), "cuStreamBeginCapture")
        return self

    def __exit__(self, kind, value, traceback) -> None:
        driver = _driver()
        graph = check(driver.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        if kind is None:
            self.exec = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def replay(self) -> None:
        _check_held(_held("cuGraphLaunch")(int(self.exec), int(self.stream)), "cuGraphLaunch")
