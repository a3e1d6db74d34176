"""Kernels that move rows without arithmetic: embedding lookups, and concatenation along the last dim (a column
copy an input)."""

from pegainfer.backends.planning import static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, VariantSpec
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.ir.graph import Graph, Node


def plan_embedding(graph: Graph, node: Node) -> KernelSpec:
    (embedding,) = node.attrs["nodes"]
    types = graph.value_types() | {embedding.outputs[0]: embedding.output_types[0]}
    ids, table = embedding.inputs
    hidden = types[table].shape[1]
    block = min(1024, next_pow2(hidden))
    p = Params(types, static_layout(graph))
    for name, value in (("ids_ptr", ids), ("table_ptr", table), ("out_ptr", embedding.outputs[0])):
        p.tensor(name, value)
    p.stride("stride_out", embedding.outputs[0])
    row_symbol = types[ids].shape[0]
    first_id = embedding.attrs.get("first_id")  # a rank's part of the vocabulary: ids outside it give zeros
    lookup = launch("embedding.py", "embedding_kernel", p,
                    dict(HIDDEN=hidden, BLOCK=block, SCALE=float(embedding.attrs.get("scale", 1.0)),
                         FIRST_ID=-1 if first_id is None else first_id, ROWS=types[table].shape[0]),
                    (GridDim((row_symbol,)), GridDim((hidden,), block)))
    return kernel_spec(graph, node, row_symbol, [VariantSpec("default", None, [lookup])])


def plan_concat(graph: Graph, node: Node) -> KernelSpec:
    """A copy of each input into its columns of the output, one launch an input."""
    (concat,) = node.attrs["nodes"]
    types = graph.value_types() | {concat.outputs[0]: concat.output_types[0]}
    out = concat.outputs[0]
    row_symbol, offset, copies = types[out].shape[0], 0, []
    for source in concat.inputs:
        width = types[source].shape[-1]
        p = Params(types, static_layout(graph))
        p.tensor("src_ptr", source)
        p.tensor("out_ptr", out)
        p.stride("stride_src", source)
        p.stride("stride_out", out)
        block = min(1024, next_pow2(width))
        copies.append(launch("concat.py", "copy_columns_kernel", p, dict(WIDTH=width, OFFSET=offset, BLOCK=block),
                             (GridDim((row_symbol,)), GridDim((width,), block))))
        offset += width
    return kernel_spec(graph, node, row_symbol, [VariantSpec("default", None, copies)])
