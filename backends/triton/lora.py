"""The LoRA update (ir/ops/lora.py) as two launches a step: each row's A(x) under its adapter's slot, in float32
partial sums over slices of K (x times a norm weight, and its sum of squares, where lora_add normalises x), then
scale x B(their sum) a tile of outputs at a time, added in place to the base projection's output for `lora_add`.
A program a row, except where a block of BLOCK_M rows has one slot (a prompt chunk's rows, a step's of one adapter):
there one program reads the tables once for the block, in a tensor-core product (punica's SGMV, for rows in runs of
one adapter), and the others stop."""

from pegainfer.backends.planning import static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, VariantSpec
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.ir.dtypes import FP32
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.types import TensorType

TEMPLATE = "lora.py"
PARTS = "lora.parts"
BLOCK_K, SPLIT_K, BLOCK_N = 128, 256, 64  # a slice of K per shrink program: 10 programs a row at K = 2560
SHRINK_R = 32  # the shrink's rank tile: a grouped rank (3 x 64 for Q/K/V) in several, registers bounded
BLOCK_M = 32  # rows whose tables are read once, by one program, where they share an adapter's slot


def plan_lora(graph: Graph, node: Node) -> KernelSpec:
    """`lora` (the update alone) or `lora_add` (base + update, in place)."""
    (lora,) = node.attrs["nodes"]
    add = lora.op == "lora_add"
    base, (x, a, b, scale, slots, *norm) = (lora.inputs[0] if add else None), lora.inputs[add:]
    norm = norm[0] if norm else None
    out = lora.outputs[0]
    types = graph.value_types() | dict(zip(lora.outputs, lora.output_types))
    rows, k = types[x].shape
    rank, n = types[a].shape[1], types[b].shape[1]
    block_k = min(BLOCK_K, next_pow2(k))
    split_k = max(block_k, SPLIT_K // block_k * block_k)
    splits = -(-k // split_k)
    width = rank + (norm is not None)  # a slice's partial sums, and its sum of squares for the norm
    parts = TensorType(FP32, (rows, splits * width))
    types, layout = types | {PARTS: parts}, static_layout(graph) | {PARTS: (splits * width, 0)}
    p = Params(types, layout)
    for name, value in (("x_ptr", x), ("norm_ptr", norm), ("a_ptr", a), ("slots_ptr", slots), ("part_ptr", PARTS)):
        p.tensor(name, value)
    p.stride("stride_x", x)
    p.dim("M", rows)
    shrink = launch(TEMPLATE, "lora_shrink_kernel", p,
                    dict(K=k, RANK=rank, SPLIT_K=split_k, SPLITS=splits, BLOCK_M=BLOCK_M,
                         BLOCK_R=min(SHRINK_R, max(16, next_pow2(rank))), BLOCK_K=block_k, NORM=norm is not None),
                    (GridDim((rows,)), GridDim((k,), split_k)))
    q = Params(types, layout)
    for name, value in (("part_ptr", PARTS), ("b_ptr", b), ("scale_ptr", scale), ("slots_ptr", slots),
                        ("base_ptr", base or out), ("out_ptr", out)):
        q.tensor(name, value)
    q.stride("stride_base", base or out)
    q.stride("stride_out", out)
    q.dim("M", rows)
    block_n = min(BLOCK_N, next_pow2(n))
    expand = launch(TEMPLATE, "lora_expand_kernel", q,
                    dict(N=n, K=k, RANK=rank, SPLITS=splits, BLOCK_M=BLOCK_M, BLOCK_R=max(16, next_pow2(rank)),
                         BLOCK_N=block_n, NORM=norm is not None, EPS=float(lora.attrs.get("eps", 0.0)), ADD=add),
                    (GridDim((rows,)), GridDim((n,), block_n)))
    spec = kernel_spec(graph, node, rows, [VariantSpec("rows", None, [shrink, expand])])
    spec.scratch = {PARTS: (parts.dtype.name, parts.shape)}
    return spec
