"""Kernel nodes: a fusion group of primitive nodes run as one launch. The group keeps its primitive nodes (with
their names) so that the reference interpreter runs it, and the verifier checks it, exactly as before fusion."""

from pegainfer.ir.graph import KERNEL, REPEAT, Node
from pegainfer.ir.registry import VIEW, get_op


def inner_nodes(node: Node) -> tuple[Node, ...]:
    return node.attrs["nodes"] if node.op == KERNEL else ()


def in_place_outputs(node: Node) -> dict[str, str]:
    """Output name -> the input it is (written in place, so never rounded, copied or given a buffer)."""
    if node.op == REPEAT:
        return {}
    if node.op == KERNEL:
        aliases: dict[str, str] = {}
        for inner in inner_nodes(node):
            for out, source in in_place_outputs(inner).items():
                aliases[out] = aliases.get(source, source)
        return {out: source for out, source in aliases.items() if out in node.outputs}
    op = get_op(node.op)
    return {node.outputs[i]: node.inputs[position] for i, position in enumerate(op.mutates)}


def is_view(node: Node) -> bool:
    return node.op not in (KERNEL, REPEAT) and get_op(node.op).category == VIEW


def kernel_kind(node: Node) -> str:
    return node.attrs["kind"]


def fused_ops(node: Node) -> list[str]:
    """The primitive ops a kernel runs, views left out."""
    return [inner.op for inner in inner_nodes(node) if not is_view(inner)]
