"""Planning CuTe DSL candidates: the decode GEMVs, one variant per Triton row slot of up to 16 rows (1, 4, 16),
for every GEMM kernel whose prologue and epilogue the template covers (not the LM-head tail's row gather)."""

from pathlib import Path

from pegainfer.backends.spec import GridDim, LaunchSpec, Param, VariantSpec
from pegainfer.backends.triton.plan import PlanOptions, gemm_roles, static_layout
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.kernel import fused_ops

KERNELS = Path(__file__).parent / "kernels"
SMS = (80, 86, 89, 90)
BUCKETS = ((1, "gemv_1", 2), (4, "gemv_4", 2), (16, "gemv_16", 2))  # rows, name, weight rows per warp
WARPS = 4


def candidates(graph: Graph, node: Node, options: PlanOptions) -> list[VariantSpec]:
    if "linear" not in fused_ops(node):
        return []
    try:
        roles = gemm_roles(node)
    except Exception:  # a shape the GEMM family does not cover
        return []
    types = graph.value_types() | {o: t for n in node.attrs["nodes"] for o, t in zip(n.outputs, n.output_types)}
    layout = static_layout(graph)
    if roles["rows"] or roles["top_k"] or roles["bias"] or roles["act"] not in (0, 1) or roles["norm_offset"]:
        return []  # gathers, sampler tails, biases, GELU, 1 + weight norms: only the Triton templates take them
    n, k = roles["n"], types[roles["weight"]].shape[1]
    dense = {roles["x"]: k, roles["out"]: n} | ({roles["x2"]: k} if roles["x2"] else {}) \
        | ({roles["sum"]: k} if roles["sum"] else {})
    if any(types[v].dtype.name != "bf16" or layout[v] != (width, 0) for v, width in dense.items()) \
            or types[roles["weight"]].dtype.name != "bf16" or k % 256 or (roles["x2"] and not roles["norm"]):
        return []
    row_symbol = types[roles["x"]].shape[0]
    x = roles["x"]
    params = [Param("x", "tensor", x, "*bf16", True), Param("x2", "tensor", roles["x2"] or x, "*bf16", True),
              Param("g", "tensor", roles["norm"] or x, "*bf16", True),
              Param("w", "tensor", roles["weight"], "*bf16", True), Param("y", "tensor", roles["out"], "*bf16", True),
              Param("s", "tensor", roles["sum"] or x, "*bf16", True), Param("m", "int", f"dim:{row_symbol}", "i32")]
    variants = []
    for rows, name, cols in BUCKETS:
        if n % (cols * WARPS):
            continue
        constexprs = dict(ROWS=rows, N=n, K=k, ACT=roles["act"], NORM=roles["norm"] is not None,
                          ADD=roles["x2"] is not None, WRITE_SUM=roles["sum"] is not None, EPS=float(roles["eps"]),
                          COLS=cols, WARPS=WARPS)
        launch = LaunchSpec("gemv", "gemv.py", (KERNELS / "gemv.py").read_text(), params, constexprs,
                            (GridDim((n,), cols * WARPS), GridDim(), GridDim()), WARPS, 1, backend="cute")
        variants.append(VariantSpec(name, rows, [launch], "cute", sms=SMS))
    return variants
