"""The LoRA update (ir/ops/lora.py) as two launches a step: each row's A(x) under its adapter's slot, in float32
partial sums over slices of K (x times a norm weight, and its sum of squares, where lora_add normalises x), then
scale x B(their sum) a tile of outputs at a time, added in place to the base projection's output for `lora_add`.
A decode step's rows read their slots' tables apart; a longer step's blocks of rows of one slot (a prompt chunk's)
read them once, in tensor-core products (punica's SGMV, for rows in runs of one adapter)."""

from pegainfer.backends.planning import static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, VariantSpec
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.ir.dtypes import FP32
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.types import TensorType

TEMPLATE = "lora.py"
PARTS = "lora.parts"
BLOCK_K, SPLIT_K, BLOCK_N = 128, 256, 64  # a slice of K per shrink program: 10 programs a row at K = 2560
SHRINK_R, EXPAND_R = 32, 64  # rank tiles: a grouped rank (3 x 64 for Q/K/V) in several, registers bounded
ROW_STEPS = 16  # steps of at most this many rows run a program a row; longer ones (prompt chunks) blocks of rows
BLOCK_M = 32  # the rows of a block, which share an adapter's tables read once where they share its slot


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

    def shrink_params(blocks: bool) -> Params:
        p = Params(types, layout)
        for name, value in (("x_ptr", x), ("norm_ptr", norm), ("a_ptr", a), ("slots_ptr", slots),
                            ("part_ptr", PARTS)):
            p.tensor(name, value)
        p.stride("stride_x", x)
        if blocks:
            p.dim("M", rows)
        return p

    def expand_params(blocks: bool) -> Params:
        q = Params(types, layout)
        for name, value in (("part_ptr", PARTS), ("b_ptr", b), ("scale_ptr", scale), ("slots_ptr", slots),
                            ("base_ptr", base or out), ("out_ptr", out)):
            q.tensor(name, value)
        q.stride("stride_base", base or out)
        q.stride("stride_out", out)
        if blocks:
            q.dim("M", rows)
        return q
    shrinks = dict(K=k, RANK=rank, SPLIT_K=split_k, SPLITS=splits, BLOCK_R=min(SHRINK_R, max(16, next_pow2(rank))),
                   BLOCK_K=block_k, NORM=norm is not None)
    block_n = min(BLOCK_N, next_pow2(n))
    expands = dict(N=n, K=k, RANK=rank, SPLITS=splits, BLOCK_N=block_n, NORM=norm is not None,
                   EPS=float(lora.attrs.get("eps", 0.0)), ADD=add)
    by_row = [launch(TEMPLATE, "lora_shrink_kernel", shrink_params(False), shrinks,
                     (GridDim((rows,)), GridDim((k,), split_k))),
              launch(TEMPLATE, "lora_expand_kernel", expand_params(False),
                     expands | dict(BLOCK_R=min(EXPAND_R, max(16, next_pow2(rank)))),
                     (GridDim((rows,)), GridDim((n,), block_n)))]
    by_block = [launch(TEMPLATE, "lora_shrink_blocks_kernel", shrink_params(True), shrinks | dict(BLOCK_M=BLOCK_M),
                       (GridDim((rows,), BLOCK_M), GridDim((k,), split_k))),
                launch(TEMPLATE, "lora_expand_blocks_kernel", expand_params(True),
                       expands | dict(BLOCK_M=BLOCK_M, BLOCK_R=max(16, next_pow2(rank))),
                       (GridDim((rows,), BLOCK_M), GridDim((n,), block_n)))]
    spec = kernel_spec(graph, node, rows, [VariantSpec("rows", ROW_STEPS, by_row),
                                           VariantSpec("blocks", None, by_block)])
    spec.scratch = {PARTS: (parts.dtype.name, parts.shape)}
    return spec
