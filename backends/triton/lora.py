"""The LoRA update (ir/ops/lora.py) as two launches a step: each row's A(x) under its adapter's slot into float32
scratch [tokens, rank], then scale x B(that) a tile of outputs at a time. A row of slot -1 writes zeros. Every row
reads its slot's tables apart, which suits decode steps; a step of many rows of one adapter would rather group them
(punica's SGMV), a later tile."""

from pegainfer.backends.planning import static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, VariantSpec
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.ir.dtypes import FP32
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.types import TensorType

TEMPLATE = "lora.py"
SHRUNK = "lora.shrunk"
BLOCK_K, BLOCK_N = 128, 64
SHRINK_R, EXPAND_R = 32, 64  # rank tiles: a grouped rank (3 x 64 for Q/K/V) in several, registers bounded


def plan_lora(graph: Graph, node: Node) -> KernelSpec:
    (lora,) = node.attrs["nodes"]
    x, a, b, scale, slots = lora.inputs
    out = lora.outputs[0]
    types = graph.value_types() | dict(zip(lora.outputs, lora.output_types))
    rows, k = types[x].shape
    rank, n = types[a].shape[1], types[b].shape[1]
    shrunk = TensorType(FP32, (rows, rank))
    types, layout = types | {SHRUNK: shrunk}, static_layout(graph) | {SHRUNK: (rank, 0)}
    p = Params(types, layout)
    for name, value in (("x_ptr", x), ("a_ptr", a), ("slots_ptr", slots), ("shrunk_ptr", SHRUNK)):
        p.tensor(name, value)
    p.stride("stride_x", x)
    shrink = launch(TEMPLATE, "lora_shrink_kernel", p,
                    dict(K=k, RANK=rank, BLOCK_R=(shrink_r := min(SHRINK_R, max(16, next_pow2(rank)))),
                         BLOCK_K=min(BLOCK_K, next_pow2(k))), (GridDim((rows,)), GridDim((rank,), shrink_r)))
    q = Params(types, layout)
    for name, value in (("shrunk_ptr", SHRUNK), ("b_ptr", b), ("scale_ptr", scale), ("slots_ptr", slots),
                        ("out_ptr", out)):
        q.tensor(name, value)
    q.stride("stride_out", out)
    block_n = min(BLOCK_N, next_pow2(n))
    expand_r = min(EXPAND_R, max(16, next_pow2(rank)))
    expand = launch(TEMPLATE, "lora_expand_kernel", q, dict(N=n, RANK=rank, BLOCK_R=expand_r, BLOCK_N=block_n),
                    (GridDim((rows,)), GridDim((n,), block_n)))
    spec = kernel_spec(graph, node, rows, [VariantSpec("rows", None, [shrink, expand])])
    spec.scratch = {SHRUNK: (shrunk.dtype.name, shrunk.shape)}
    return spec
