"""Pattern fusions for the transformer building blocks, written over op names and categories, never over model
names, so any architecture built from these ops gets them."""

from pegainfer.ir.dtypes import INT32
from pegainfer.ir.graph import KERNEL, REPEAT, Graph, Node
from pegainfer.ir.kernel import inner_nodes, kernel_kind
from pegainfer.ir.registry import COLLECTIVE, ELEMENTWISE, GATHER, ROW_REDUCTION, get_op
from pegainfer.ir.step import (SAMPLER_OUTPUTS, SAMPLING_INPUTS, TOP_LOGPROBS, mask_input_types,
                               penalty_input_types)
from pegainfer.ir.types import TensorType
from pegainfer.passes.manager import PassLog
from pegainfer.passes.rewrite import consumers, for_each_graph, fresh_name, fuse, only_reader

GLU_ACTIVATIONS = ("silu", "gelu_tanh")
TAIL_TOP_K = 64  # candidates the sampler tail keeps per row: top-k sampling and logprobs up to this many


def split_residual_carry(graph: Graph, log: PassLog) -> Graph:
    """Carries a repeated layer's residual as the two addends of its last add, so that add runs at the start of
    the next layer, fused with that layer's RMSNorm (and after the last layer, with the final norm)."""
    for node in [n for n in graph.nodes if n.op == REPEAT]:
        body = graph.subgraphs[node.attrs["body"]]
        last = body.producers().get(body.outputs[0]) if len(body.outputs) == 1 else None
        if last is None or last.op != "add" or consumers(body).get(body.outputs[0]):
            log.note(f"{body.name}: left alone: its single carried output is not a residual add read by nothing else")
            continue
        _split_carry(graph, node, body, last)
        log.note(f"{body.name}: carries (%{last.inputs[0]}, %{last.inputs[1]}) instead of %{last.name}")
    return graph


def _split_carry(graph: Graph, repeat: Node, body: Graph, last: Node) -> None:
    carried, carried_type = next(iter(body.inputs.items()))
    pair = [fresh_name(body, f"{carried}.residual"), fresh_name(body, f"{carried}.delta")]
    body.inputs = {pair[0]: carried_type, pair[1]: carried_type,
                   **{k: v for k, v in body.inputs.items() if k != carried}}
    body.nodes = [Node("add", tuple(pair), (carried,), (carried_type,))] + [n for n in body.nodes if n is not last]
    body.outputs = list(last.inputs)
    start = repeat.inputs[0]
    zeros = fresh_name(graph, f"{start}.zeros")
    outputs = (fresh_name(graph, f"{repeat.name}.residual"), fresh_name(graph, f"{repeat.name}.delta"))
    at = graph.nodes.index(repeat)
    total = Node("add", outputs, (repeat.outputs[0],), (carried_type,))
    repeat.inputs = (start, zeros, *repeat.inputs[1:])
    repeat.outputs, repeat.output_types = outputs, (carried_type, carried_type)
    graph.nodes[at:at + 1] = [Node("zeros_like", (start,), (zeros,), (carried_type,)), repeat, total]


def fuse_add_rms_norm(graph: Graph, log: PassLog) -> Graph:
    """Fuses a residual add with the RMSNorm of its sum: one kernel writes both the new residual and the normed rows."""
    def rewrite(g: Graph) -> None:
        producers = g.producers()
        for norm in [n for n in g.nodes if n.op == "rms_norm"]:
            source = producers.get(norm.inputs[0])
            if source is not None and source.op == "add":
                _fuse_or_note(g, [source, norm], "add_rms_norm", log, name=norm.name)
    return for_each_graph(graph, rewrite)


def fuse_qk_norm_rope_kv_write(graph: Graph, log: PassLog) -> Graph:
    """Fuses the per-head work between the QKV projection and attention (q/k norms, RoPE) with the KV-cache write."""
    def rewrite(g: Graph) -> None:
        readers = consumers(g)
        producers = g.producers()
        for write in [n for n in g.nodes if n.op == "kv_write"]:
            attention = [n for n in readers.get(write.outputs[0], []) if n.op == "paged_attention"]
            k_chain = _row_chain(g, write.inputs[2], readers, producers)
            q_chain = _row_chain(g, attention[0].inputs[0], readers, producers) if attention else []
            ops = list(dict.fromkeys("norm" if n.op == "rms_norm" else n.op for n in k_chain))
            kind = f"qk_{'_'.join(ops)}_kv_write" if ops else "kv_write"
            _fuse_or_note(g, [*q_chain, *k_chain, write], kind, log, name=kind.removesuffix("_kv_write"))
    return for_each_graph(graph, rewrite)


def _row_chain(g: Graph, value: str, readers, producers, categories=(ELEMENTWISE, ROW_REDUCTION)) -> list[Node]:
    """The chain of row-local primitive nodes that produces `value`, each read by the next alone (source first)."""
    chain: list[Node] = []
    node = producers.get(value)
    while node is not None and node.op not in (KERNEL, REPEAT) and get_op(node.op).category in categories:
        if chain and only_reader(g, node.outputs[0], readers) is not chain[0]:
            break
        chain.insert(0, node)
        node = producers.get(node.inputs[0])
    return chain


def fuse_gemm_activation_epilogue(graph: Graph, log: PassLog) -> Graph:
    """Fuses act(gate) x up into the epilogue of the merged gate/up GEMM: the [tokens, 2I] output never hits memory."""
    def rewrite(g: Graph) -> None:
        readers = consumers(g)
        producers = g.producers()
        for mul in [n for n in g.nodes if n.op == "mul"]:
            members = _glu_pattern(g, mul, readers, producers)
            if members:
                _fuse_or_note(g, members, f"linear_{members[2].op}_mul", log)
    return for_each_graph(graph, rewrite)


def _glu_pattern(g: Graph, mul: Node, readers, producers) -> list[Node] | None:
    """[linear, split, act, mul] when mul = act(split#0) * split#1 over one linear's output, else None."""
    act = producers.get(mul.inputs[0])
    if act is None or act.op not in GLU_ACTIVATIONS or only_reader(g, act.outputs[0], readers) is not mul:
        return None
    split = producers.get(act.inputs[0])
    if split is None or split.op != "split" or split.outputs != (act.inputs[0], mul.inputs[1]):
        return None
    linear = producers.get(split.inputs[0])
    if linear is None or linear.op != "linear" or only_reader(g, linear.outputs[0], readers) is not split:
        return None
    if only_reader(g, split.outputs[1], readers) is not mul:
        return None
    return [linear, split, act, mul]


def plan_sampler_tail(graph: Graph, log: PassLog) -> Graph:
    """Plans the final norm, the LM head and the sampler as one tail: each row's grammar mask (a step input, -1 for
    none), then its penalties (sparse step inputs, none by default), top-k candidates of the penalised logits and
    logsumexp of the masked ones (logprobs), and one token per row drawn on the device (ir/ops/sampling.py) from
    the per-row sampling inputs it adds. In a sharded graph, whose logits are gathered from the ranks' parts of the
    vocabulary, the tail is a kernel of its own after the gather (`sampler_tail`)."""
    logits = graph.outputs[0]
    head = graph.producers().get(logits)
    gathered = _gathered(graph, head)
    if head is None or (head.op != "linear" and gathered is None):
        log.note(f"{graph.name}: left alone: the first output is not produced by a linear")
        return graph
    taken = [name for name in (*SAMPLING_INPUTS, TOP_LOGPROBS) if name in graph.value_types()]
    if taken:
        log.note(f"{graph.name}: left alone: it already defines {', '.join(taken)}")
        return graph
    logits_type = head.output_types[0]
    k = min(TAIL_TOP_K, logits_type.shape[-1])
    names = [fresh_name(graph, name) for name in SAMPLER_OUTPUTS]
    rows = logits_type.shape[0]  # one set of sampling parameters per row of logits, whatever its symbol
    masks = mask_input_types(rows)
    graph.inputs.update(masks)
    masked = fresh_name(graph, "masked_logits")  # a row's grammar mask, before its top-k, logprobs and draw
    mask = Node("mask_tokens", (logits, *masks), (masked,),
                (get_op("mask_tokens").infer(logits_type, *masks.values()),))
    penalties = penalty_input_types(rows)
    graph.inputs.update(penalties)
    penalized = fresh_name(graph, "penalized_logits")  # what the row is drawn from; its logprobs stay the masked
    penalized_type = get_op("penalize_tokens").infer(logits_type, *penalties.values())
    penalize = Node("penalize_tokens", (masked, *penalties), (penalized,), (penalized_type,))
    graph.inputs[TOP_LOGPROBS] = TensorType(INT32, (rows,))
    top_k = Node("top_k", (penalized, TOP_LOGPROBS), tuple(names[0:2]),
                 get_op("top_k").infer(penalized_type, graph.inputs[TOP_LOGPROBS], k=k), {"k": k})
    lse = Node("logsumexp", (masked,), (names[2],), (get_op("logsumexp").infer(logits_type),))
    inputs = {name: TensorType(t.dtype, (rows,)) for name, t in SAMPLING_INPUTS.items()}
    graph.inputs.update(inputs)
    attrs = {"candidates": k, "logits_dtype": penalized_type.dtype.name}
    sample = Node("sample", (penalized, *inputs, masked), tuple(names[3:5]),
                  get_op("sample").infer(penalized_type, *inputs.values(), logits_type, **attrs), attrs)
    graph.nodes += [mask, penalize, top_k, lse, sample]
    graph.outputs += names
    if gathered:
        _fuse_head_part(graph, gathered, log)
        _fuse_or_note(graph, [mask, penalize, top_k, lse, sample], "sampler_tail", log, name="sampler")
        return graph
    readers = consumers(graph)
    prologue = _row_chain(graph, head.inputs[0], readers, graph.producers(),
                          categories=(ELEMENTWISE, ROW_REDUCTION, GATHER))
    _fuse_or_note(graph, [*prologue, head, mask, penalize, top_k, lse, sample], "lm_head_tail", log,
                  name="lm_head")
    return graph


def _gathered(graph: Graph, node: Node | None) -> Node | None:
    """The linear (the LM head's part on this rank) whose output `node` gathers from the ranks: `node` a
    collective, or a view of one's output (the split that drops a vocabulary's padding); else None."""
    producers = graph.producers()
    while node is not None and node.op == "split":
        node = producers.get(node.inputs[0])
    if node is None or node.op in (KERNEL, REPEAT) or get_op(node.op).category != COLLECTIVE:
        return None
    head = producers.get(node.inputs[0])
    return head if head is not None and head.op == "linear" else None


def _fuse_head_part(graph: Graph, head: Node, log: PassLog) -> None:
    """A sharded LM head with its prologue (the rows gathered, the final norm): the kernel before the gather."""
    prologue = _row_chain(graph, head.inputs[0], consumers(graph), graph.producers(),
                          categories=(ELEMENTWISE, ROW_REDUCTION, GATHER))
    members = [*prologue, head]
    _fuse_or_note(graph, members, "_".join(n.op for n in members), log, name="lm_head")


def fuse_norm_prologue(graph: Graph, log: PassLog) -> Graph:
    """Fuses an RMSNorm (with its residual add) into the prologue of the GEMM that alone reads its output."""
    def rewrite(g: Graph) -> None:
        readers = consumers(g)
        producers = g.producers()
        for gemm in [n for n in g.nodes if _first_op(n) == "linear" and "norm" not in _kind(n)]:
            norm = producers.get(_first_node(gemm).inputs[0])
            if norm is None or not _kind(norm).endswith("rms_norm"):
                continue
            if only_reader(g, _first_node(gemm).inputs[0], readers) is not gemm:
                log.note(f"{g.name}: %{norm.name} not fused into %{gemm.name}: its output is read elsewhere too")
                continue
            _fuse_or_note(g, [norm, gemm], f"{_kind(norm)}_{_kind(gemm)}", log)
    return for_each_graph(graph, rewrite)


def fuse_weight_dequantize(graph: Graph, log: PassLog) -> Graph:
    """Folds an FP8 weight's dequantize into the GEMM that alone reads it: the weight is read as FP8 and scaled in
    registers (the bytes a decode step streams are halved), never written back in the model's dtype."""
    def rewrite(g: Graph) -> None:
        readers = consumers(g)
        for dequantize in [n for n in g.nodes if n.op == "dequantize"]:
            gemm = only_reader(g, dequantize.outputs[0], readers)
            linear = next((n for n in inner_nodes(gemm) or (gemm,) if n.op == "linear"), None) if gemm else None
            if linear is None or linear.inputs[1] != dequantize.outputs[0]:
                log.note(f"{g.name}: %{dequantize.name} left a kernel of its own: no single GEMM reads it as its "
                         f"weight")
                continue
            _fuse_or_note(g, [dequantize, gemm], f"dequantize_{_kind(gemm)}", log)
    return for_each_graph(graph, rewrite)


def _kind(node: Node) -> str:
    return kernel_kind(node) if node.op == KERNEL else node.op


def _first_node(node: Node) -> Node:
    return inner_nodes(node)[0] if node.op == KERNEL else node


def _first_op(node: Node) -> str:
    return _first_node(node).op


def _fuse_or_note(g: Graph, members: list[Node], kind: str, log: PassLog, name: str | None = None) -> None:
    if fuse(g, members, kind, name) is None:
        log.note(f"{g.name}: could not fuse {', '.join('%' + n.name for n in members)} as {kind}: a node outside "
                 f"the group sits between its members")
