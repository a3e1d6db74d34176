"""The verifier: every value defined once, no dangling edges, no cycles, nodes in topological order, every
node's recorded output types equal to what its op's type rule gives, and each state written by its kind of op."""

from pegainfer.errors import GraphError
from pegainfer.ir.dag import find_cycle
from pegainfer.ir.graph import KERNEL, LAYER_PLACEHOLDER, REPEAT, Graph, Node, has_placeholder
from pegainfer.ir.kernel import in_place_outputs, inner_nodes
from pegainfer.ir.registry import CACHE_WRITE, RECURRENCE, get_op, infer_types
from pegainfer.ir.step import SLOT_POOL, STATE_SLOTS, STEP_INPUTS
from pegainfer.ir.types import TensorType


def verify(graph: Graph, *, body: bool = False) -> None:
    """Raises GraphError naming the graph and node at fault. A body (run by `repeat`) may name per-layer values."""
    for sub in graph.subgraphs.values():
        if sub.subgraphs:
            raise GraphError(f"graph {sub.name}: nested bodies are not supported")
        _verify_one(sub, graph)
    _verify_one(graph, graph)
    _check_step_bindings(graph)
    if body:
        return
    for name in (*graph.params, *graph.states):
        if has_placeholder(name):
            raise GraphError(f"graph {graph.name}: {name!r} uses {LAYER_PLACEHOLDER} outside a repeated body")


def _check_step_bindings(graph: Graph) -> None:
    """A body input named as a step input (ir/step.py's STEP_INPUTS) must be the model's input of that name, passed
    unchanged to every layer: kernels read step inputs before waiting on the kernel before them."""
    for node in graph.nodes:
        if node.op != REPEAT or node.attrs.get("body") not in graph.subgraphs:
            continue
        body = graph.subgraphs[node.attrs["body"]]
        carried = len(body.outputs)
        for index, name in enumerate(body.inputs):
            bound = node.inputs[index] if index < len(node.inputs) else None
            if name in STEP_INPUTS and (index < carried or bound != name or name not in graph.inputs):
                raise GraphError(f"graph {graph.name}, node %{node.name} (repeat): body input {name!r} is a step "
                                 f"input's name, so it must be bound, as a layer invariant, to the graph's input "
                                 f"{name!r}; found {bound!r}" + (" (carried)" if index < carried else ""))


def _verify_one(graph: Graph, root: Graph) -> None:
    defined = _check_declarations(graph)
    all_outputs = {out for node in graph.nodes for out in node.outputs}
    for node in graph.nodes:
        for value in node.inputs:
            if value not in defined and value not in all_outputs:
                raise GraphError(f"graph {graph.name}, node %{node.name} ({node.op}): input {value!r} is not defined "
                                 f"anywhere (dangling edge)")
    names, edges = graph.dataflow()
    cycle = find_cycle(names, edges)
    if cycle:
        raise GraphError(f"graph {graph.name}: cycle through {' -> '.join(cycle)}")
    _verify_nodes(graph.name, graph.nodes, defined, set(graph.states), root, frozenset(graph.outputs))
    for out in graph.outputs:
        if out not in defined:
            raise GraphError(f"graph {graph.name}: output {out!r} is not defined")


def _verify_nodes(where: str, nodes, defined: dict[str, TensorType], stateful: set[str], root: Graph,
                  outputs: frozenset[str] = frozenset()) -> None:
    """Checks nodes in order against the values defined before each (`outputs`: the graph's); adds their outputs
    to `defined`."""
    for node in nodes:
        missing = [v for v in node.inputs if v not in defined]
        if missing:
            raise GraphError(f"graph {where}, node %{node.name} ({node.op}): input {missing[0]!r} is used "
                             f"before the node that defines it")
        if node.op == KERNEL:
            _verify_kernel(where, node, defined, stateful, root)
        else:
            expected = _expected_types(node, defined, root)
            if expected != node.output_types:
                raise GraphError(f"graph {where}, node %{node.name} ({node.op}): recorded output types "
                                 f"{_fmt(node.output_types)} but the op's rule gives {_fmt(expected)}")
        _check_mutation(where, node, stateful, nodes, outputs)
        if node.op not in (KERNEL, REPEAT):
            _check_state_kind(where, node, defined)
        for out, type_ in zip(node.outputs, node.output_types):
            if out in defined:
                raise GraphError(f"graph {where}, node %{node.name}: value {out!r} defined twice")
            defined[out] = type_


def _verify_kernel(where: str, node: Node, defined: dict[str, TensorType], stateful: set[str], root: Graph) -> None:
    """A kernel's primitive nodes must check on their own, over the kernel's inputs alone."""
    inner = inner_nodes(node)
    if not inner or any(n.op in (KERNEL, REPEAT) for n in inner):
        raise GraphError(f"graph {where}, kernel %{node.name}: must hold primitive nodes only")
    local = {name: defined[name] for name in node.inputs}
    _verify_nodes(f"{where}, kernel %{node.name}", inner, local, {v for v in node.inputs if v in stateful}, root)
    for out, type_ in zip(node.outputs, node.output_types):
        if local.get(out) != type_:
            raise GraphError(f"graph {where}, kernel %{node.name}: output {out!r} is {local.get(out)} inside, "
                             f"{type_} outside")


def _check_declarations(graph: Graph) -> dict[str, TensorType]:
    defined: dict[str, TensorType] = {}
    for table in (graph.inputs, graph.params, graph.states):
        for name, type_ in table.items():
            if name in defined:
                raise GraphError(f"graph {graph.name}: value {name!r} declared twice")
            defined[name] = type_
    return defined


def _expected_types(node: Node, defined: dict[str, TensorType], root: Graph) -> tuple[TensorType, ...]:
    input_types = [defined[v] for v in node.inputs]
    if node.op == REPEAT:
        return _repeat_types(node, input_types, root)
    try:
        return infer_types(node.op, input_types, node.attrs)
    except (GraphError, TypeError) as error:
        raise GraphError(f"node %{node.name} ({node.op}): {error}") from None


def _check_mutation(where: str, node: Node, stateful: set[str], nodes, outputs: frozenset[str]) -> None:
    """A cache write or recurrence writes in place into a state (or the result of an earlier write to one); any
    other op only into an activation it alone reads: writing into one other nodes read would change their value."""
    writes_state = node.op not in (KERNEL, REPEAT) and get_op(node.op).category in (CACHE_WRITE, RECURRENCE)
    for out, source in in_place_outputs(node).items():
        if source in stateful:
            stateful.add(out)
        elif writes_state or source in outputs or any(source in n.inputs for n in nodes if n is not node):
            raise GraphError(f"graph {where}, node %{node.name} ({node.op}): writes in place into {source!r}, which "
                             f"is not a state" + ("" if writes_state else " and is read elsewhere too"))


def _check_state_kind(where: str, node: Node, defined: dict[str, TensorType]) -> None:
    """A recurrence writes rows of a state pool ([SLOT_POOL, ...]) picked by the step's STATE_SLOTS, the input after
    its state; a cache write writes token slots of a paged cache, never a pool of per-sequence rows."""
    op = get_op(node.op)
    if op.category not in (RECURRENCE, CACHE_WRITE):
        return
    for position in op.mutates:
        state = defined[node.inputs[position]]
        pooled = state.shape[0] == SLOT_POOL
        if op.category == CACHE_WRITE and pooled:
            raise GraphError(f"graph {where}, node %{node.name} ({node.op}): writes token slots into "
                             f"{node.inputs[position]!r} {state}, a pool of per-sequence state rows")
        if op.category == RECURRENCE and not pooled:
            raise GraphError(f"graph {where}, node %{node.name} ({node.op}): its state {node.inputs[position]!r} "
                             f"must be a pool of per-sequence rows [{SLOT_POOL}, ...], found {state}")
    if op.category == RECURRENCE and node.inputs[op.mutates[-1] + 1] != STATE_SLOTS:
        raise GraphError(f"graph {where}, node %{node.name} ({node.op}): its rows must be picked by the step "
                         f"input {STATE_SLOTS!r}, found {node.inputs[op.mutates[-1] + 1]!r}")


def _repeat_types(node: Node, input_types: list[TensorType], root: Graph) -> tuple[TensorType, ...]:
    body = root.subgraphs.get(node.attrs.get("body", ""))
    if body is None:
        raise GraphError(f"node %{node.name} (repeat): no body named {node.attrs.get('body')!r}")
    count = node.attrs.get("count")
    if not isinstance(count, int) or count < 1:
        raise GraphError(f"node %{node.name} (repeat): count must be a positive integer, found {count!r}")
    expected_inputs = list(body.inputs.values())
    if input_types != expected_inputs:
        raise GraphError(f"node %{node.name} (repeat): body {body.name} takes {_fmt(expected_inputs)}, "
                         f"given {_fmt(input_types)}")
    carried = tuple(input_types[: len(body.outputs)])
    produced = tuple(body.value_types()[out] for out in body.outputs)
    if produced != carried:
        raise GraphError(f"node %{node.name} (repeat): body {body.name} returns {_fmt(produced)} but its carried "
                         f"inputs are {_fmt(carried)}")
    return carried


def _fmt(types) -> str:
    return "(" + ", ".join(str(t) for t in types) + ")"
