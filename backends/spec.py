"""What a backend plans for one kernel node of the kernel DAG, in the form the manifest records and the runtime
launches: variants chosen by the number of rows, each a list of launches with an explicit parameter ABI."""

from dataclasses import asdict, dataclass, field
from math import prod


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


PLANES = "planes:"  # a tensor value naming a split GEMM's fp32 planes of a graph value (planes_of)
PLANE_ROWS = 16  # rows a plane holds, whatever the step's (decode_gemm.py's ROWS, rows.py's PLANE_ROWS)


def planes_of(value: str) -> str:
    """The name a split GEMM's planes of `value` go by: its scratch, and the norm launch's P that adds them."""
    return PLANES + value


@dataclass(frozen=True)
class Param:
    """One kernel parameter, in order. kind 'tensor': `value` names a graph value (its pointer is passed);
    kind 'int': `value` is 'stride:<graph value>' (its leading-dim stride, in elements), 'rows:<graph value>' (its
    leading dim) or 'dim:<symbol>'. A tensor value 'planes:<graph value>' (planes_of) names a split GEMM's fp32
    planes of that value (runtime/gpu/planes.py).
    The TileLang and CuTe DSL backends name their kernel's buffers here; the ABI they record in the manifest is
    read from the compiler's output, in its order, with kinds of its own (tma: a descriptor passed by value)."""
    name: str
    kind: str
    value: str
    dtype: str  # Triton's signature type: *bf16, *fp32, *i32, i32
    aligned: bool = False  # a pointer the runtime guarantees 16-byte aligned (compiled with that hint)


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


def fits(max_rows: int | None, rows: int) -> bool:
    """Whether a variant made for at most `max_rows` rows (None: any number) serves a step of `rows` rows."""
    return max_rows is None or rows <= max_rows


def serves(variant: dict, row_symbol: str, sizes: dict[str, int]) -> bool:
    """A manifest variant serves a step when its row bound fits and every size it asks a minimum of reaches it
    (an attention variant with 128-query tiles asks for max_query_len >= 64: prefill-shaped steps only)."""
    return fits(variant["max_rows"], sizes[row_symbol]) and all(
        sizes[name] >= least for name, least in variant.get("min_sizes", {}).items())


def pick_variant(kernel: dict, sizes: dict[str, int]) -> dict:
    """The first of a manifest kernel's variants that serves the step: the runtime's rule."""
    for variant in kernel["variants"]:
        if serves(variant, kernel["row_symbol"], sizes):
            return variant
    rows = sizes[kernel["row_symbol"]]
    raise AssertionError(f"kernel {kernel['node']}: no variant for {kernel['row_symbol']}={rows}")


@dataclass
class VariantSpec:
    name: str
    max_rows: int | None  # use this variant when the row count is at most this; None: otherwise
    launches: list[LaunchSpec]
    backend: str = "triton"
    min_sizes: dict[str, int] = field(default_factory=dict)  # other step sizes this variant needs at least
    sms: tuple[int, ...] | None = None  # the SMs it compiles for; None: every SM the build supports

    @property
    def slot(self) -> tuple:
        """Variants of one slot are alternatives (one per backend or tile shape); selection keeps one per slot."""
        return (self.max_rows, tuple(sorted(self.min_sizes.items())))

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.name}"


@dataclass
class KernelSpec:
    graph: str
    node: str
    kind: str
    ops: list[str]
    row_symbol: str  # the symbol that picks the variant (tokens, samples, batch)
    variants: list[VariantSpec] = field(default_factory=list)
    scratch: dict[str, tuple[str, tuple[str | int, ...]]] = field(default_factory=dict)  # name -> (dtype, shape)

    def variant_for(self, sizes: dict[str, int]) -> VariantSpec:
        for variant in self.variants:
            if serves({"max_rows": variant.max_rows, "min_sizes": variant.min_sizes}, self.row_symbol, sizes):
                return variant
        raise AssertionError(f"kernel {self.node}: no variant for {self.row_symbol}={sizes[self.row_symbol]}")

    def as_json(self) -> dict:
        data = asdict(self)
        for variant in data["variants"]:
            for launch in variant["launches"]:
                del launch["source"]
        return data
