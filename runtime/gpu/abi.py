"""Packing a launch's arguments by the manifest's parameter ABI: device pointers by graph value, row strides,
step sizes, and Triton's trailing scratch pointers. Pure Python: tested on the CPU."""

import ctypes
from dataclasses import dataclass
from math import prod

from pegainfer.backends.spec import GridDim
from pegainfer.ir.dtypes import DType


@dataclass(frozen=True)
class DeviceTensor:
    ptr: int
    shape: tuple[int, ...]
    dtype: DType
    row_stride: int  # elements between consecutive leading indices; the inner dims are contiguous

    @classmethod
    def contiguous(cls, ptr: int, shape: tuple[int, ...], dtype: DType) -> "DeviceTensor":
        return cls(ptr, tuple(shape), dtype, prod(shape[1:]) if len(shape) > 1 else 1)

    def reshape(self, shape: tuple[int, ...]) -> "DeviceTensor":
        return DeviceTensor(self.ptr, tuple(shape), self.dtype, self.row_stride)

    def row(self, index: int) -> "DeviceTensor":
        """Leading index `index` alone, as a [1, ...] tensor."""
        return DeviceTensor(self.ptr + index * self.row_stride * self.dtype.itemsize, (1, *self.shape[1:]),
                            self.dtype, self.row_stride)

    def columns(self, start: int, width: int) -> "DeviceTensor":
        """The view of columns start .. start+width of the last dim (a split)."""
        return DeviceTensor(self.ptr + start * self.dtype.itemsize, (*self.shape[:-1], width), self.dtype,
                            self.row_stride)


class PackedArguments:
    """ctypes storage for each argument and the array of pointers to them that cuLaunchKernel reads."""

    def __init__(self, values: list[ctypes._SimpleCData]) -> None:
        self.values = values
        self.pointers = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])

    @property
    def address(self) -> int:
        return ctypes.addressof(self.pointers)


def pack_arguments(params: list[dict], tensors: dict[str, DeviceTensor], sizes: dict[str, int],
                   scratch: dict[str, int] | None = None) -> PackedArguments:
    values: list[ctypes._SimpleCData] = []
    for param in params:
        kind, value = param["kind"], param["value"]
        if kind == "tensor":
            values.append(ctypes.c_uint64(tensors[value].ptr))
        elif kind == "scratch":
            values.append(ctypes.c_uint64((scratch or {}).get(param["name"], 0)))
        else:
            what, _, name = value.partition(":")
            number = tensors[name].row_stride if what == "stride" else sizes[name]
            assert -2**31 <= number < 2**31, f"{param['name']}={number} does not fit an i32 parameter"
            values.append(ctypes.c_int32(number))
    return PackedArguments(values)


def grid_of(launch: dict, sizes: dict[str, int]) -> tuple[int, int, int]:
    """The launch's grid for this step, by the rule the manifest records (backends/spec.GridDim)."""
    return tuple(GridDim.from_json(dim).size(sizes) for dim in launch["grid"])
