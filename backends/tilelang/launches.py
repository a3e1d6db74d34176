"""A TileLang launch as the plan records it: its template's source (with the kernels modules it imports, so that the
cache key covers them) and its parameters."""

import re
from pathlib import Path

from pegainfer.backends.spec import GridDim, LaunchSpec, Param, ParamKind

KERNELS = Path(__file__).parent / "kernels"
SM90_SHARED = 228 * 1024  # an SM's shared memory, of which each resident CTA also holds 1 KB for the system


def source(template: str) -> str:
    """The template's text and that of the kernels modules it imports (decode_ring.py, gemm.py): a change to a
    shared piece rebuilds every form built on it."""
    text = (KERNELS / template).read_text()
    shared = re.findall(r"^from pegainfer\.backends\.tilelang\.kernels\.(\w+) import", text, re.M)
    return text + "".join((KERNELS / f"{name}.py").read_text() for name in shared)


def launch(template: str, function: str, params: list[Param], constexprs: dict, grid: tuple[GridDim, ...],
           threads: int, stages: int = 1) -> LaunchSpec:
    grid = tuple(grid) + (GridDim(),) * (3 - len(grid))
    return LaunchSpec(function, template, source(template), params, constexprs, grid, threads // 32, stages,
                      backend="tilelang")


def tensor(name: str, value: str, dtype: str = "*bf16") -> Param:
    return Param(name, ParamKind.TENSOR, value, dtype, aligned=True)
