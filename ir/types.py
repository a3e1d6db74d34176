"""Tensor types: a dtype and a shape whose entries are integers or named symbols (tokens, batch, ...)."""

from dataclasses import dataclass
from math import prod

from pegainfer.ir.dtypes import DType

Dim = int | str


@dataclass(frozen=True)
class TensorType:
    dtype: DType
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        for dim in self.shape:
            assert isinstance(dim, (int, str)) and not isinstance(dim, bool), f"bad dim {dim!r} in {self.shape}"
            assert not isinstance(dim, int) or dim >= 0, f"negative dim in {self.shape}"

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def symbols(self) -> set[str]:
        return {d for d in self.shape if isinstance(d, str)}

    def with_shape(self, shape: tuple[Dim, ...]) -> "TensorType":
        return TensorType(self.dtype, tuple(shape))

    def concrete(self, bindings: dict[str, int]) -> tuple[int, ...]:
        """The shape with every symbol replaced by its value; a missing symbol is a bug of the caller."""
        return tuple(d if isinstance(d, int) else bindings[d] for d in self.shape)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


def same_elements(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> bool:
    """Whether two symbolic shapes surely hold the same number of elements (used by reshape)."""
    ints_a = prod(d for d in a if isinstance(d, int))
    ints_b = prod(d for d in b if isinstance(d, int))
    syms_a = sorted(d for d in a if isinstance(d, str))
    syms_b = sorted(d for d in b if isinstance(d, str))
    return ints_a == ints_b and syms_a == syms_b
