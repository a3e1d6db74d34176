"""TMA descriptors for TileLang's kernels: the manifest records each descriptor as TileLang's lowering describes
it (dims innermost first, byte strides with the element size first, box, swizzle...), a dim that is a step size by
its symbol; for each new (parameter, address, step sizes) the runtime resolves the sizes, checks what the hardware
requires, and encodes the 128-byte CUtensorMap with cuTensorMapEncodeTiled (kept: runtime/gpu/launch.py's
DescriptorBlobs). The kernel takes it by value (__grid_constant__)."""

from collections.abc import Callable
from dataclasses import dataclass

from pegainfer.backends.spec import TmaDescriptor
from pegainfer.errors import PegainferError

TENSOR_MAP_BYTES = 128


@dataclass(frozen=True)
class TiledDescriptor:
    """cuTensorMapEncodeTiled's arguments, every size resolved."""
    dtype: int
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]  # bytes, of dims 1.. (the driver's globalStrides: the element size left out)
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int


def resolve(descriptor: TmaDescriptor, address: int, sizes: dict[str, int]) -> TiledDescriptor:
    """The manifest's descriptor for this step: symbols replaced by sizes, then checked."""
    def size(dim: int | str) -> int:
        if isinstance(dim, int):
            return dim
        if dim not in sizes:
            raise PegainferError(f"TMA descriptor dim {dim!r} is not a size of this step ({', '.join(sizes)})")
        return sizes[dim]
    strides = [size(s) for s in descriptor.strides]
    resolved = TiledDescriptor(descriptor.dtype, address, tuple(size(dim) for dim in descriptor.dims),
                               tuple(strides[1:]), descriptor.box, descriptor.element_strides, descriptor.interleave,
                               descriptor.swizzle, descriptor.l2_promotion, descriptor.oob_fill)
    check(resolved, element_bytes=strides[0])
    return resolved


def check(d: TiledDescriptor, element_bytes: int) -> None:
    """What cuTensorMapEncodeTiled refuses, said before calling it: it answers only CUDA_ERROR_INVALID_VALUE."""
    rank = len(d.dims)
    problems = []
    if not 1 <= rank <= 5 or len(d.box) != rank or len(d.element_strides) != rank or len(d.strides) != rank - 1:
        problems.append(f"rank {rank} with box {d.box}, element strides {d.element_strides}, strides {d.strides}")
    if d.address % 16:
        problems.append(f"global address {d.address:#x} is not 16-byte aligned")
    if any(s % 16 or s >= 2**40 for s in d.strides):
        problems.append(f"strides {d.strides} must be multiples of 16 bytes below 2^40")
    if any(not 0 < dim <= 2**32 for dim in d.dims):
        problems.append(f"dims {d.dims} must lie in 1 .. 2^32")
    if any(not 0 < b <= 256 for b in d.box) or (d.box[0] * element_bytes) % 16:
        problems.append(f"box {d.box} must lie in 1 .. 256 with an inner extent of a multiple of 16 bytes")
    if d.swizzle and d.box[0] * element_bytes > 16 * 2 ** d.swizzle:
        problems.append(f"box inner extent {d.box[0] * element_bytes} B exceeds swizzle mode {d.swizzle}'s span")
    if problems:
        raise PegainferError("TMA descriptor: " + "; ".join(problems))


def encode_tiled(d: TiledDescriptor) -> bytes:
    """The 128-byte CUtensorMap, from the driver (needs libcuda, not a context)."""
    from cuda.bindings import driver

    from pegainfer.runtime.cuda.driver import check as check_status

    wide, narrow = driver.cuuint64_t, driver.cuuint32_t  # the bindings take their own integer types in lists
    tensor_map = check_status(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(d.dtype), len(d.dims), d.address, [wide(x) for x in d.dims],
        [wide(x) for x in d.strides], [narrow(x) for x in d.box], [narrow(x) for x in d.element_strides],
        driver.CUtensorMapInterleave(d.interleave), driver.CUtensorMapSwizzle(d.swizzle),
        driver.CUtensorMapL2promotion(d.l2_promotion), driver.CUtensorMapFloatOOBfill(d.oob_fill)),
        f"cuTensorMapEncodeTiled(dims={d.dims}, box={d.box})")
    return b"".join(int(word).to_bytes(8, "little") for word in tensor_map.opaque)


Encoder = Callable[[TiledDescriptor], bytes]
