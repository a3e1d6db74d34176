"""Token mixers other than paged attention, for one rank (passes/shard.py): multi-head latent attention by query
heads (the latent and its cache shared by every head, so replicated; kv_b's rows of the rank's heads), and Gated
DeltaNet by key and value heads (the convolution's channels and its state, the delta rule's per-head state)."""

from typing import TYPE_CHECKING, Callable

from pegainfer.errors import GraphError
from pegainfer.ir.graph import Node
from pegainfer.ir.registry import infer_types
from pegainfer.passes.shard_layout import Layout, Split, check_grouped_heads
from pegainfer.passes.shard_regions import is_checkpoint_weight

if TYPE_CHECKING:
    from pegainfer.passes.shard import Sharder


def shard_latent_attention(sharder: "Sharder", node: Node, splits: list[Layout | None]) -> None:
    """mla_attention of this rank's query heads: their rows of kv_b, against the whole latent cache."""
    q_nope, q_rope, *rest = splits
    kv_b = node.inputs[3]
    if not isinstance(q_nope, Split) or q_nope != q_rope or q_nope.dim != 1 or any(rest):
        raise GraphError(f"tensor parallelism: %{node.name} reads its query parts split differently ({q_nope}, "
                         f"{q_rope}) or its latent cache split")
    if not is_checkpoint_weight(sharder.g, kv_b):
        raise GraphError(f"tensor parallelism: %{node.name}'s kv_b {kv_b} is no checkpoint tensor to slice")
    per_head = sharder.declared[kv_b].shape[0] // q_nope.full
    sharder.weights.slice(kv_b, 0, q_nope.start * per_head, q_nope.stop * per_head)
    sharder.emit(node, node.inputs)
    sharder.layout[node.outputs[0]] = q_nope


def shard_convolution(sharder: "Sharder", node: Node, splits: list[Layout | None]) -> None:
    """A depthwise causal convolution of this rank's channels: their taps and their columns of the state."""
    layout = splits[0]
    if layout is None or layout.dim != 1 or any(splits[1:]):
        raise GraphError(f"tensor parallelism: %{node.name} reads its channels as {layout} and its taps or state "
                         f"split")
    taps = _sliced_taps(sharder, node, layout)
    sharder.resize_state(node.inputs[2], 1, layout.size)
    sharder.emit(node, (node.inputs[0], taps, *node.inputs[2:]))
    sharder.layout[node.outputs[1]] = layout


def _sliced_taps(sharder: "Sharder", node: Node, layout: Layout) -> str:
    """The convolution's taps cut to this rank's channels: a checkpoint tensor, or a reshape of one (emitted
    already, so re-emitted over the cut tensor)."""
    taps = node.inputs[1]
    if taps in sharder.g.params:
        return sharder.weights.rows(taps, layout.ranges())
    index = next(i for i, n in enumerate(sharder.nodes) if taps in n.outputs)
    reshape = sharder.nodes[index]
    if reshape.op != "reshape" or len(sharder.readers.get(taps, [])) != 1:
        raise GraphError(f"tensor parallelism: %{node.name}'s taps come from %{reshape.name} ({reshape.op}), "
                         f"read elsewhere too or no reshape of a checkpoint tensor")
    source = sharder.weights.rows(reshape.inputs[0], layout.ranges())
    attrs = {**reshape.attrs, "shape": (layout.size, *reshape.attrs["shape"][1:])}
    types = infer_types("reshape", [sharder.types[source]], attrs)
    sharder.nodes[index] = Node("reshape", (source,), reshape.outputs, types, attrs)
    sharder.types[taps] = types[0]
    return taps


def shard_delta_rule(sharder: "Sharder", node: Node, splits: list[Layout | None]) -> None:
    """The gated delta rule of this rank's value heads, each reading the key head it belongs to."""
    q, k, v, decay, beta, *rest = splits
    if any(s is None for s in (q, k, v, decay, beta)) or any(rest) or q != k or \
            not (v.same_part(decay) and v.same_part(beta)):
        raise GraphError(f"tensor parallelism: %{node.name} reads q {q}, k {k}, v {v}, g {decay} and beta {beta}, "
                         f"not split alike by heads, or its state split")
    check_grouped_heads(f"%{node.name}", v, q)
    sharder.resize_state(node.inputs[5], 1, v.size)
    sharder.emit(node, node.inputs)
    sharder.layout[node.outputs[1]] = v


MIXERS: dict[str, Callable[["Sharder", Node, list[Layout | None]], None]] = {
    "mla_attention": shard_latent_attention, "causal_conv1d": shard_convolution,
    "gated_delta_rule": shard_delta_rule}
