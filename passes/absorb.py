"""Latent attention in its absorbed form: kv_b_proj's key rows folded into the query, its value rows into the output,
so that attention runs in the latent space against the one cached latent head (ir/ops/latent_attention.py)."""

from pegainfer.ir.graph import Derivation, Graph, Node
from pegainfer.ir.types import TensorType
from pegainfer.passes.manager import PassLog
from pegainfer.passes.rewrite import for_each_graph, fresh_name


def absorb_latent_attention(graph: Graph, log: PassLog) -> Graph:
    """Rewrites mla_attention as head_linear(q, kv_b's key rows) + latent_attention + head_linear(kv_b's value
    rows), the two row sets derived params of the checkpoint's kv_b."""
    def rewrite(g: Graph) -> None:
        for node in [n for n in g.nodes if n.op == "mla_attention"]:
            kv_b = node.inputs[3]
            if kv_b not in g.params or kv_b in g.derived:
                log.note(f"{g.name}: %{node.name} left expanded: its kv_b %{kv_b} is not a checkpoint weight "
                         f"(an FP8 weight's dequantize, or derived)")
                continue
            _absorb(g, node)
            log.note(f"{g.name}: %{node.name} absorbed over @{kv_b}")
    return for_each_graph(graph, rewrite)


def _absorb(g: Graph, node: Node) -> None:
    q_nope, q_rope, cache, kv_b, *packed = node.inputs
    heads, nope = g.value_types()[q_nope].shape[1:]
    value_dim = node.output_types[0].shape[2]
    kv_type = g.params[kv_b]
    latent = kv_type.shape[1]
    per_head = nope + value_dim
    keys = _row_param(g, kv_b, ".keys", [(h * per_head, h * per_head + nope) for h in range(heads)])
    values = _row_param(g, kv_b, ".values", [(h * per_head + nope, (h + 1) * per_head) for h in range(heads)])
    q_type = g.value_types()[q_nope]
    q_latent, o_latent = fresh_name(g, f"{node.name}.q_latent"), fresh_name(g, f"{node.name}.latent")
    latent_type = q_type.with_shape((q_type.shape[0], heads, latent))
    new = [Node("head_linear", (q_nope, keys), (q_latent,), (latent_type,), {"transposed": True}),
           Node("latent_attention", (q_latent, q_rope, cache, *packed), (o_latent,), (latent_type,),
                {"scale": node.attrs["scale"]}),
           Node("head_linear", (o_latent, values), node.outputs, node.output_types)]
    at = g.nodes.index(node)
    g.nodes[at:at + 1] = new
    if not any(kv_b in n.inputs for n in g.nodes):
        g.params.pop(kv_b)


def _row_param(g: Graph, source: str, suffix: str, rows: list[tuple[int, int]]) -> str:
    """Declares the rows `rows` of the checkpoint weight `source`, in order, as a derived param."""
    t = g.params[source]
    name = fresh_name(g, source.removesuffix(".weight") + suffix + ".weight")
    g.params[name] = TensorType(t.dtype, (sum(b - a for a, b in rows), t.shape[1]))
    g.derived[name] = Derivation((source,), (t,), 0, tuple((0, a, b) for a, b in rows))
    return name
