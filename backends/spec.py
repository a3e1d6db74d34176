"""What a backend plans for one kernel node of the kernel DAG, in the form the manifest records and the runtime
launches: variants chosen by the number of rows, each a list of launches with an explicit parameter ABI."""

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import cached_property
from math import prod
from typing import Protocol, TypeVar


@dataclass(frozen=True)
class GridDim:
    """cdiv(product of factors, block) * times; factors are ints or step-size symbols (tokens, batch...)."""
    factors: tuple[str | int, ...] = (1,)
    block: int = 1
    times: int = 1

    def size(self, sizes: dict[str, int]) -> int:
        """At least 1: an empty step still launches one program, which its masks keep idle."""
        total = prod(f if isinstance(f, int) else sizes[f] for f in self.factors)
        return max(1, -(-total // self.block) * self.times)

    @classmethod
    def from_json(cls, data: dict) -> "GridDim":
        return cls(tuple(data["factors"]), data["block"], data.get("times", 1))


PLANE_ROWS = 16  # rows a plane holds, whatever the step's (TileLang's rows.py PLANE_ROWS, decode_ring.py ROWS)


def plane_stride(constexprs: dict) -> int:
    """The rows of one plane a launch writes, adds or reads, from its constexprs (decode_planes.py's 16 unless
    they say otherwise: the swapped tiles' PLANE_STRIDE)."""
    return constexprs.get("PLANE_STRIDE", PLANE_ROWS)


def planes_of(value: str) -> str:
    """The name a split GEMM's fp32 planes of `value` go by: its scratch, and the buffer a PLANES parameter reads."""
    return "planes:" + value


class ParamKind(StrEnum):
    """What the runtime passes for a kernel parameter (runtime/gpu/launch.py), read off the step's buffers and
    sizes; `Param.value` names the graph value (or scratch) it reads, or the step symbol of a DIM."""
    TENSOR = "tensor"  # the value's pointer
    PLANES = "planes"  # the pointer of a split GEMM's fp32 planes of the value (runtime/gpu/planes.py)
    TMA = "tma"  # a CUtensorMap of the value's memory, by value (Param.tma describes it)
    SCRATCH = "scratch"  # one of Triton's trailing scratch pointers, null (its value is the size it asked: 0)
    STRIDE = "stride"  # i32: the value's leading-dim stride, in elements
    ROWS = "rows"  # i32: the value's leading dim
    PLANE_ROWS = "plane_rows"  # i32: the rows of the value's planes (none where it is stored whole)
    DIM = "dim"  # i32: a step size

    @property
    def is_int(self) -> bool:
        """An i32 argument; the others are pointers or, for TMA, a descriptor."""
        return self in (ParamKind.STRIDE, ParamKind.ROWS, ParamKind.PLANE_ROWS, ParamKind.DIM)


@dataclass(frozen=True)
class TmaDescriptor:
    """A tiled TMA descriptor as TileLang's lowering describes it (cuTensorMapEncodeTiled's arguments): dims
    innermost first, byte strides with the element size first; a dim that is a step size is its symbol."""
    dtype: int
    dims: tuple[int | str, ...]
    strides: tuple[int | str, ...]
    box: tuple[int, ...]
    element_strides: tuple[int, ...]
    interleave: int
    swizzle: int
    l2_promotion: int
    oob_fill: int

    @classmethod
    def from_json(cls, data: dict) -> "TmaDescriptor":
        return cls(data["dtype"], tuple(data["dims"]), tuple(data["strides"]), tuple(data["box"]),
                   tuple(data["element_strides"]), data["interleave"], data["swizzle"], data["l2_promotion"],
                   data["oob_fill"])

    def as_json(self) -> dict:
        return {"dtype": self.dtype, "rank": len(self.dims), **{k: v for k, v in asdict(self).items() if k != "dtype"}}


@dataclass(frozen=True)
class Param:
    """One kernel parameter, in order. The TileLang and CuTe DSL backends name their kernel's buffers here; the ABI
    they record in the manifest is read from the compiler's output, in its order."""
    name: str
    kind: ParamKind
    value: str
    dtype: str  # Triton's signature type: *bf16, *fp32, *i32, i32 (tma: a descriptor)
    aligned: bool = False  # a pointer the runtime guarantees 16-byte aligned (compiled with that hint)
    tma: TmaDescriptor | None = None  # a TMA parameter's descriptor
    skip: str | None = None  # a TENSOR's pointer this many rows (a step size) into its buffer

    @cached_property  # read for every argument of every launch
    def buffer(self) -> str | None:
        """The buffer whose pointer, descriptor or size this parameter reads (None: a step size or scratch)."""
        if self.kind in (ParamKind.PLANES, ParamKind.PLANE_ROWS):
            return planes_of(self.value)
        return None if self.kind in (ParamKind.DIM, ParamKind.SCRATCH) else self.value

    @classmethod
    def from_json(cls, data: dict) -> "Param":
        tma = TmaDescriptor.from_json(data["tma"]) if data.get("tma") is not None else None
        return cls(data["name"], ParamKind(data["kind"]), data["value"], data["dtype"], data.get("aligned", False),
                   tma, data.get("skip"))

    def as_json(self) -> dict:
        data = {"name": self.name, "kind": str(self.kind), "value": self.value, "dtype": self.dtype,
                "aligned": self.aligned}
        return data | ({"tma": self.tma.as_json()} if self.tma is not None else {}) | \
            ({"skip": self.skip} if self.skip is not None else {})


@dataclass
class LaunchSpec:
    function: str  # the @triton.jit function's name
    module: str  # the file holding it: a template under backends/triton/kernels/ or generated source
    source: str  # that file's text (the cache key covers it)
    params: list[Param]
    constexprs: dict[str, int | float | bool | None]
    grid: tuple[GridDim, GridDim, GridDim]
    num_warps: int = 4
    num_stages: int = 2
    backend: str = "triton"  # which compiler builds it: triton, tilelang, cute
    # run by the runtime only where a kernel after it reads what it writes (a split GEMM's sum of its planes, which a
    # norm launch after it can add itself)
    deferred: bool = False


class Slotted:
    """What a planned variant and a compiled one share: the slot it fills and its label."""
    name: str
    backend: str
    max_rows: int | None  # serves steps of at most this many rows; None: any number
    min_sizes: dict[str, int]  # other step sizes it needs at least

    @property
    def slot(self) -> tuple:
        """Variants of one slot are alternatives (one per backend or tile shape); selection keeps one per slot."""
        return (self.max_rows, tuple(sorted(self.min_sizes.items())))

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.name}"


@dataclass
class VariantSpec(Slotted):
    name: str
    max_rows: int | None
    launches: list[LaunchSpec]
    backend: str = "triton"
    min_sizes: dict[str, int] = field(default_factory=dict)
    sms: tuple[int, ...] | None = None  # the SMs it compiles for; None: every SM the build supports


@dataclass
class KernelSpec:
    graph: str
    node: str
    kind: str
    ops: list[str]
    row_symbol: str  # the symbol that picks the variant (tokens, samples, batch)
    variants: list[VariantSpec] = field(default_factory=list)
    scratch: dict[str, tuple[str, tuple[str | int, ...]]] = field(default_factory=dict)  # name -> (dtype, shape)


V = TypeVar("V", bound=Slotted, covariant=True)


class Variants(Protocol[V]):
    """A kernel with variants: planned (KernelSpec) or compiled (the manifest's Kernel)."""
    node: str
    row_symbol: str

    @property
    def variants(self) -> Sequence[V]: ...


def slot_rank(slot: tuple) -> tuple:
    """The order the runtime tries slots in: conditional ones (minimum sizes) first, those with more conditions
    before those with fewer (a mixed step's attention before a prefill step's), then by row bound, unbounded last."""
    return (not slot[1], -len(slot[1]), slot[0] is None, slot[0] or 0)


def serves(variant: Slotted, row_symbol: str, sizes: dict[str, int]) -> bool:
    """A variant serves a step when its row bound fits and every size it asks a minimum of reaches it (an attention
    variant with 128-query tiles asks for max_query_len >= 64: prefill-shaped steps only)."""
    return (variant.max_rows is None or sizes[row_symbol] <= variant.max_rows) and all(
        sizes[name] >= least for name, least in variant.min_sizes.items())


def pick_variant(kernel: Variants[V], sizes: dict[str, int]) -> V:
    """The variant a step launches: the first that serves it, slots in the runtime's order (a manifest's variants
    are in that order already; a plan's keep each slot's alternatives in order, its default first)."""
    return first_serving(kernel, runtime_order(kernel.variants), sizes)


def runtime_order(variants: Sequence[V]) -> list[V]:
    return sorted(variants, key=lambda v: slot_rank(v.slot))


def first_serving(kernel: Variants[V], ordered: Sequence[V], sizes: dict[str, int]) -> V:
    """pick_variant over variants already in runtime_order (the executor sorts each kernel's once)."""
    for variant in ordered:
        if serves(variant, kernel.row_symbol, sizes):
            return variant
    raise AssertionError(f"kernel {kernel.node}: no variant for {kernel.row_symbol}={sizes[kernel.row_symbol]}")
