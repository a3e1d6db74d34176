"""Planning that every backend shares: the options a plan is made under, the static layout of a graph's values,
and the roles of a GEMM kernel's inner nodes, which each backend's templates are specialised by."""

from dataclasses import dataclass
from itertools import accumulate
from math import prod

from pegainfer.errors import PegainferError
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.kernel import in_place_outputs

PREFILL_QUERIES = 64  # attention takes prefill-shaped tiles when some sequence of the step brings this many queries


@dataclass(frozen=True)
class PlanOptions:
    block_size: int = 16  # KV-cache block size: a compile-time constant of the attention kernel
    split_kv_max_batch: int = 16  # up to this many sequences attention splits each one's keys over programs


def static_layout(graph: Graph) -> dict[str, tuple[int | None, int]]:
    """value -> (row stride in elements, or None when it depends on a step size; byte offset from the start of
    its allocation). Views keep their source's stride; a split moves the offset by the columns before it; an
    output written in place (lora_add into a split's part) is its source."""
    layout: dict[str, tuple[int | None, int]] = {}
    for name, t in graph.value_types().items():
        inner = t.shape[1:]
        layout[name] = (prod(inner) if all(isinstance(d, int) for d in inner) else None, 0)
    for node in graph.nodes:
        layout |= {out: layout[source] for out, source in in_place_outputs(node).items() if source in layout}
        if node.op == "reshape":
            layout[node.outputs[0]] = layout[node.inputs[0]]
        elif node.op == "split":
            stride, offset = layout[node.inputs[0]]
            itemsize = node.output_types[0].dtype.itemsize
            for out, start in zip(node.outputs, [0, *accumulate(node.attrs["sizes"])]):
                layout[out] = (stride, offset + start * itemsize)
    return layout


def gemm_roles(node: Node) -> dict:
    """Reads the kernel's primitive nodes in order: [dequantize] [add] [gather_rows] [rms_norm] linear [split act
    mul | mask_tokens penalize_tokens top_k logsumexp sample]. Anything else has no template. An FP8 weight's
    roles: `weight` the stored values, `scale` their scales, `scale_block` the rows x columns one covers."""
    inner = list(node.attrs["nodes"])
    dequantize = inner.pop(0) if inner[0].op == "dequantize" else None
    ops = [n.op for n in inner]
    roles: dict = dict(x=None, x2=None, rows=None, norm=None, eps=1e-6, norm_offset=0.0, bias=None, sum=None, act=0,
                       mask=None, penalize=None, top_k=None, lse=None, sample=None, scale=None, scale_block=None)
    index = 0
    if ops[index] == "add":
        roles["x"], roles["x2"] = inner[index].inputs
        if inner[index].outputs[0] in node.outputs:
            roles["sum"] = inner[index].outputs[0]
        index += 1
    if ops[index] == "gather_rows":
        roles["x"] = roles["x"] or inner[index].inputs[0]
        roles["rows"] = inner[index].inputs[1]
        index += 1
    if ops[index] == "rms_norm":
        roles["x"] = roles["x"] or inner[index].inputs[0]
        roles["norm"], roles["eps"] = inner[index].inputs[1], inner[index].attrs["eps"]
        roles["norm_offset"] = float(inner[index].attrs.get("offset", 0.0))
        index += 1
    linear = inner[index]
    if linear.op != "linear" or (roles["sum"] and roles["rows"]):
        raise PegainferError(f"kernel {node.name}: no GEMM template for {' + '.join(ops)}")
    roles["x"] = roles["x"] or linear.inputs[0]
    roles["weight"] = linear.inputs[1]
    if dequantize is not None:
        if dequantize.outputs[0] != roles["weight"]:
            raise PegainferError(f"kernel {node.name}: its dequantize feeds no GEMM weight")
        roles["weight"], roles["scale"] = dequantize.inputs
        roles["scale_block"] = tuple(dequantize.attrs["block"])
    roles["bias"] = linear.inputs[2] if len(linear.inputs) == 3 else None
    roles["out"] = linear.outputs[0]
    rest = ops[index + 1:]
    if rest[:1] == ["split"] and len(rest) == 3 and rest[2] == "mul":
        roles["act"] = {"silu": 1, "gelu_tanh": 2}[rest[1]]
        roles["out"] = inner[-1].outputs[0]
    elif rest == ["mask_tokens", "penalize_tokens", "top_k", "logsumexp", "sample"]:
        roles["mask"], roles["penalize"], roles["top_k"], roles["lse"], roles["sample"] = inner[-5:]
    elif rest:
        raise PegainferError(f"kernel {node.name}: no GEMM epilogue for {' + '.join(rest)}")
    n_total = linear.output_types[0].shape[-1]
    roles["n"] = n_total // 2 if roles["act"] else n_total
    return roles
