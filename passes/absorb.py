"""Latent attention in its absorbed form: kv_b_proj's key rows folded into the query, its value rows into the output,
so that attention runs in the latent space against the one cached latent head (ir/ops/latent_attention.py)."""

from pegainfer.ir.graph import Derivation, Graph, Node
from pegainfer.ir.types import TensorType
from pegainfer.passes.manager import PassLog
from pegainfer.passes.rewrite import for_each_graph, fresh_name


def absorb_latent_attention(graph: Graph, log: PassLog) -> Graph:
    """Rewrites mla_attention as head_linear(q, kv_b's key rows) + latent_attention + head_linear(kv_b's value
    rows), the two row sets derived params of the checkpoint's kv_b (an FP8 one dequantized at load)."""
    def rewrite(g: Graph) -> None:
        producers = g.producers()
        for node in [n for n in g.nodes if n.op == "mla_attention"]:
            source = _kv_b_source(g, node.inputs[3], producers.get(node.inputs[3]))
            if source is None:
                log.note(f"{g.name}: %{node.name} left expanded: its kv_b %{node.inputs[3]} is not a checkpoint "
                         f"weight")
                continue
            _absorb(g, node, source)
            log.note(f"{g.name}: %{node.name} absorbed over @{source[0]}")
    return for_each_graph(graph, rewrite)


def _kv_b_source(g: Graph, kv_b: str, producer: Node | None) -> tuple[str, Node | None] | None:
    """(the checkpoint weight kv_b is, the dequantize that reads it or None), or None when kv_b is neither."""
    if kv_b in g.params and kv_b not in g.derived:
        return kv_b, None
    if producer is not None and producer.op == "dequantize" and all(
            i in g.params and i not in g.derived for i in producer.inputs):
        return producer.inputs[0], producer
    return None


def _absorb(g: Graph, node: Node, source: tuple[str, Node | None]) -> None:
    q_nope, q_rope, cache, kv_b, *packed = node.inputs
    heads, nope = g.value_types()[q_nope].shape[1:]
    value_dim = node.output_types[0].shape[2]
    kv_type = g.value_types()[kv_b]
    latent = kv_type.shape[1]
    per_head = nope + value_dim
    keys = _row_param(g, source, kv_type, ".keys", [(h * per_head, h * per_head + nope) for h in range(heads)])
    values = _row_param(g, source, kv_type, ".values",
                        [(h * per_head + nope, (h + 1) * per_head) for h in range(heads)])
    q_type = g.value_types()[q_nope]
    q_latent, o_latent = fresh_name(g, f"{node.name}.q_latent"), fresh_name(g, f"{node.name}.latent")
    latent_type = q_type.with_shape((q_type.shape[0], heads, latent))
    new = [Node("head_linear", (q_nope, keys), (q_latent,), (latent_type,), {"transposed": True}),
           Node("latent_attention", (q_latent, q_rope, cache, *packed), (o_latent,), (latent_type,),
                {"scale": node.attrs["scale"]}),
           Node("head_linear", (o_latent, values), node.outputs, node.output_types)]
    at = g.nodes.index(node)
    g.nodes[at:at + 1] = new
    weight, dequantize = source
    if dequantize is not None and not any(kv_b in n.inputs for n in g.nodes):
        g.nodes.remove(dequantize)
    for param in dequantize.inputs if dequantize is not None else (weight,):
        if not any(param in n.inputs for n in g.nodes):
            g.params.pop(param)


def _row_param(g: Graph, source: tuple[str, Node | None], kv_type: TensorType, suffix: str,
               rows: list[tuple[int, int]]) -> str:
    """Declares the rows `rows` of kv_b, in order, as a derived param of the checkpoint weight (and of its scales,
    dequantized at load, when kv_b is an FP8 weight's dequantize)."""
    weight, dequantize = source
    name = fresh_name(g, weight.removesuffix(".weight") + suffix + ".weight")
    g.params[name] = kv_type.with_shape((sum(b - a for a, b in rows), kv_type.shape[1]))
    pieces = tuple((0, a, b) for a, b in rows)
    if dequantize is None:
        g.derived[name] = Derivation((weight,), (g.params[weight],), 0, pieces)
    else:
        block, dtype = dequantize.attrs["block"], dequantize.attrs["dtype"]
        g.derived[name] = Derivation(dequantize.inputs, tuple(g.params[i] for i in dequantize.inputs), 0, pieces,
                                     (block[0], block[1], dtype))
    return name
