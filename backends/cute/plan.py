"""Planning CuTe DSL candidates: the decode GEMVs, one variant per Triton row slot of up to 16 rows (1, 4, 16),
for every GEMM kernel whose prologue and epilogue the template covers (not the LM-head tail's row gather)."""

from pathlib import Path

from pegainfer.backends.native_gemm import native_gemm
from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.spec import GridDim, LaunchSpec, Param, ParamKind, VariantSpec
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.kernel import fused_ops

KERNELS = Path(__file__).parent / "kernels"
SMS = (80, 86, 89, 90)
BUCKETS = ((1, "gemv_1", 2), (4, "gemv_4", 2), (16, "gemv_16", 2))  # rows, name, weight rows per warp
WARPS = 4


def candidates(graph: Graph, node: Node, options: PlanOptions) -> list[VariantSpec]:
    if "linear" not in fused_ops(node):
        return []
    gemm = native_gemm(graph, node)
    if gemm is None or gemm.k % 256 or (gemm.roles["x2"] and not gemm.roles["norm"]):
        return []
    roles, types, n, k = gemm.roles, gemm.types, gemm.n, gemm.k
    row_symbol = types[roles["x"]].shape[0]
    x = roles["x"]
    tensors = dict(x=x, x2=roles["x2"] or x, g=roles["norm"] or x, w=roles["weight"], y=roles["out"],
                   s=roles["sum"] or x)
    params = [Param(name, ParamKind.TENSOR, value, "*bf16", True) for name, value in tensors.items()]
    params.append(Param("m", ParamKind.DIM, row_symbol, "i32"))
    variants = []
    for rows, name, cols in BUCKETS:
        if n % (cols * WARPS):
            continue
        constexprs = dict(ROWS=rows, N=n, K=k, ACT=roles["act"], NORM=roles["norm"] is not None,
                          ADD=roles["x2"] is not None, WRITE_SUM=roles["sum"] is not None, EPS=float(roles["eps"]),
                          COLS=cols, WARPS=WARPS, NORM_OFFSET=roles["norm_offset"])
        launch = LaunchSpec("gemv", "gemv.py", (KERNELS / "gemv.py").read_text(), params, constexprs,
                            (GridDim((n,), cols * WARPS), GridDim(), GridDim()), WARPS, 1, backend="cute")
        variants.append(VariantSpec(name, rows, [launch], "cute", sms=SMS))
    return variants
