"""Device views of tensors (pointer, shape, row stride): what the executor binds graph values to, and what the
launcher reads pointers, strides and sizes from (runtime/gpu/launch.py). Pure Python: tested on the CPU."""

from dataclasses import dataclass
from math import prod

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

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize

    @property
    def dense(self) -> bool:
        """Its rows back to back (no stride past a row's elements)."""
        return self.row_stride == prod(self.shape[1:])

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

