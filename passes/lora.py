"""Folds each LoRA update and the add of it to its projection into one `lora_add` that writes the base in place, and
that normalises its input itself where the input is an RMSNorm's output, leaving the norm to the GEMM's prologue."""

from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.registry import infer_types
from pegainfer.passes.manager import PassLog
from pegainfer.passes.rewrite import consumers, for_each_graph, fresh_name, only_reader, topological_order


def fuse_lora_update(graph: Graph, log: PassLog) -> Graph:
    """A merged GEMM's split and its update's split, added part by part (Q/K/V, gate/up), become one lora_add
    over the merged output, then one split: the base output is read and written once, and a step whose rows
    have no adapter can skip the update and leave the base as it is (runtime/gpu/executor.py)."""
    def rewrite(g: Graph) -> None:
        for lora in [n for n in g.nodes if n.op == "lora"]:
            readers, producers = consumers(g), g.producers()
            match = _single(g, lora, readers) or _grouped(g, lora, readers, producers)
            if match is None:
                log.note(f"{g.name}: %{lora.name} left a lora node: its update is not added alone to a "
                         f"projection read by nothing else")
                continue
            _replace(g, lora, *match)
            log.note(f"{g.name}: %{lora.name} adds to its projection in place")
        readers, producers = consumers(g), g.producers()
        for update in [n for n in g.nodes if n.op == "lora_add"]:
            norm = producers.get(update.inputs[1])
            if norm is not None and norm.op == "rms_norm" and not norm.attrs.get("offset") and \
                    len(readers[update.inputs[1]]) > 1:  # the norm stays for its GEMM, which takes it in
                update.inputs = (update.inputs[0], norm.inputs[0], *update.inputs[2:], norm.inputs[1])
                update.attrs = {"eps": norm.attrs["eps"]}
                log.note(f"{g.name}: %{update.name} normalises %{norm.inputs[0]} itself, as %{norm.name} does")
    return for_each_graph(graph, rewrite)


def _single(g: Graph, lora: Node, readers) -> tuple[str, list[Node], Node | None] | None:
    """(base, [the add], None) when the update's one reader adds it to a value only that add reads."""
    add = only_reader(g, lora.outputs[0], readers)
    base = _addend(g, add, lora.outputs[0], readers)
    return None if base is None else (base, [add], None)


def _grouped(g: Graph, lora: Node, readers, producers) -> tuple[str, list[Node], Node] | None:
    """(merged base, the adds, the base's split) when the update is split as the merged base is and each part
    is added to its part alone."""
    split = only_reader(g, lora.outputs[0], readers)
    if split is None or split.op != "split":
        return None
    adds = [only_reader(g, part, readers) for part in split.outputs]
    bases = [_addend(g, add, part, readers) for add, part in zip(adds, split.outputs)]
    base_split = producers.get(bases[0]) if bases[0] is not None else None
    if base_split is None or base_split.op != "split" or base_split.outputs != tuple(bases) or \
            base_split.attrs["sizes"] != split.attrs["sizes"] or \
            only_reader(g, base_split.inputs[0], readers) is not base_split:
        return None
    return base_split.inputs[0], [*adds, split], base_split


def _addend(g: Graph, add: Node | None, part: str, readers) -> str | None:
    """The other input of `add` (part + it), if that is read by the add alone."""
    if add is None or add.op != "add" or part not in add.inputs or len(set(add.inputs)) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] == part else add.inputs[0]
    return other if only_reader(g, other, readers) is add else None


def _replace(g: Graph, lora: Node, base: str, removed: list[Node], base_split: Node | None) -> None:
    adds = [n for n in removed if n.op == "add"]
    inputs = (base, *lora.inputs)
    types = g.value_types()
    if base_split is None:
        (add,) = adds
        fused = [Node("lora_add", inputs, add.outputs, add.output_types, {})]
    else:
        merged = fresh_name(g, base.replace(".base", ""))
        update = Node("lora_add", inputs, (merged,), infer_types("lora_add", [types[v] for v in inputs], {}), {})
        split = Node("split", (merged,), tuple(a.outputs[0] for a in adds), tuple(a.output_types[0] for a in adds),
                     dict(base_split.attrs))
        fused = [update, split]
    gone = {id(n) for n in [*removed, lora, *([base_split] if base_split else [])]}
    at = g.nodes.index(lora)
    nodes = [n for n in g.nodes[:at] if id(n) not in gone] + fused + [n for n in g.nodes[at:] if id(n) not in gone]
    ordered = topological_order(nodes)
    assert ordered is not None, f"{g.name}: folding %{lora.name} made a cycle"
    g.nodes = ordered
