"""What every Triton plan builds its launches with: the templates' folder, a collector of a launch's parameters
and the constexprs that stand for what is static, and the LaunchSpec and KernelSpec of a planned node."""

import re
from pathlib import Path

from pegainfer.backends.spec import GridDim, KernelSpec, LaunchSpec, Param, ParamKind, VariantSpec
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.kernel import fused_ops
from pegainfer.ir.types import TensorType

KERNELS = Path(__file__).parent / "kernels"
TRITON_TYPES = {"bf16": "bf16", "f16": "fp16", "f32": "fp32", "i32": "i32", "i64": "i64", "f8e4m3": "fp8e4nv",
                "f8e5m2": "fp8e5"}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class Params:
    """Collects a launch's runtime parameters, and the constexprs that stand for absent pointers and for row
    strides, which are static for every value but the block tables (so the compiler sees them, and vectorises)."""

    def __init__(self, types: dict[str, TensorType], layout: dict[str, tuple[int | None, int]]) -> None:
        self.types, self.layout = types, layout
        self.params: list[Param] = []
        self.constexprs: dict = {}

    def tensor(self, name: str, value: str | None) -> None:
        if value is None:
            self.constexprs[name] = None
        else:
            aligned = self.layout[value][1] % 16 == 0
            self.params.append(Param(name, ParamKind.TENSOR, value,
                                     "*" + TRITON_TYPES[self.types[value].dtype.name], aligned))

    def stride(self, name: str, value: str | None) -> None:
        static = self.layout[value][0] if value is not None else 0
        if static is not None:
            self.constexprs[name] = static
        else:
            self.params.append(Param(name, ParamKind.STRIDE, value, "i32"))

    def dim(self, name: str, symbol: str) -> None:
        self.params.append(Param(name, ParamKind.DIM, symbol, "i32"))


def launch(template: str, function: str, params: Params, constexprs: dict, grid: tuple[GridDim, ...],
           num_warps: int = 4, num_stages: int = 2) -> LaunchSpec:
    """A launch of `function` in the template file `template` of KERNELS."""
    grid = tuple(grid) + (GridDim(),) * (3 - len(grid))
    return LaunchSpec(function, template, template_source(template), params.params,
                      {**params.constexprs, **constexprs}, grid, num_warps, num_stages)


INCLUDE = re.compile(r"^# include: (\S+)$", re.MULTILINE)


def template_source(template: str) -> str:
    """A template's text with each `# include: FILE` line replaced by that file of KERNELS, its own includes
    expanded too (shared jit helpers: a launch's source is one self-contained module)."""
    return INCLUDE.sub(lambda m: template_source(m.group(1)), (KERNELS / template).read_text())


def kernel_spec(graph: Graph, node: Node, row_symbol: str, variants: list[VariantSpec]) -> KernelSpec:
    return KernelSpec(graph.name, node.name, node.attrs["kind"], fused_ops(node), row_symbol, variants)
