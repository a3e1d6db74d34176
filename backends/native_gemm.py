"""The GEMM kernels that the TileLang and CuTe DSL templates implement in full: [add +] RMSNorm (times weight, or
1 + weight: roles["norm_offset"], each template's NORM_OFFSET) + linear [+ SiLU x up] over bf16 rows stored whole and
back to back. Both backends offer candidates only for these, so that a setting only Triton's templates take (a
gather, the sampler tail, a bias, GELU) never reaches them."""

from dataclasses import dataclass

from pegainfer.backends.planning import gemm_roles, static_layout
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.types import TensorType


@dataclass(frozen=True)
class NativeGemm:
    roles: dict  # gemm_roles(node)
    types: dict[str, TensorType]  # the graph's values and the kernel's inner ones
    n: int  # output columns
    k: int  # reduction width


def native_gemm(graph: Graph, node: Node, fp8: bool = False) -> NativeGemm | None:
    """The kernel's roles and shapes when the native templates implement it, else None; `fp8`: the caller has
    templates for e4m3 weights with their scales too."""
    try:
        roles = gemm_roles(node)
    except Exception:  # a shape the GEMM family does not cover
        return None
    if roles["rows"] or roles["top_k"] or roles["bias"] or roles["act"] not in (0, 1):
        return None
    weights = {"f8e4m3"} if fp8 and roles["scale"] is not None else {"bf16"}
    if not {roles["weight"], roles["norm"] or roles["weight"], roles["scale"] or roles["weight"]} <= set(graph.params):
        return None  # the decode tiles read their weights before waiting for the previous kernel: parameters only
    types = graph.value_types() | {o: t for n in node.attrs["nodes"] for o, t in zip(n.outputs, n.output_types)}
    layout = static_layout(graph)
    n, k = roles["n"], types[roles["weight"]].shape[1]
    dense = {roles["x"]: k, roles["out"]: n} | ({roles["x2"]: k} if roles["x2"] else {}) \
        | ({roles["sum"]: k} if roles["sum"] else {})
    if any(types[v].dtype.name != "bf16" or layout[v] != (width, 0) for v, width in dense.items()) \
            or types[roles["weight"]].dtype.name not in weights:
        return None
    return NativeGemm(roles, types, n, k)
