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


@dataclass(frozen=True)
class Param:
    """One kernel parameter, in order. kind 'tensor': `value` names a graph value (its pointer is passed);
    kind 'int': `value` is 'stride:<graph value>' (its leading-dim stride, in elements) or 'dim:<symbol>'."""
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


def fits(max_rows: int | None, rows: int) -> bool:
    """Whether a variant made for at most `max_rows` rows (None: any number) serves a step of `rows` rows."""
    return max_rows is None or rows <= max_rows


@dataclass
class VariantSpec:
    name: str
    max_rows: int | None  # use this variant when the row count is at most this; None: otherwise
    launches: list[LaunchSpec]


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
        rows = sizes[self.row_symbol]
        for variant in self.variants:
            if fits(variant.max_rows, rows):
                return variant
        raise AssertionError(f"kernel {self.node}: no variant for {self.row_symbol}={rows}")

    def as_json(self) -> dict:
        data = asdict(self)
        for variant in data["variants"]:
            for launch in variant["launches"]:
                del launch["source"]
        return data
