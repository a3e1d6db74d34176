"""Kernel formation, and reading the kernel DAG back: which kernels a step launches and what each fuses."""

from dataclasses import dataclass

from pegainfer.ir.graph import KERNEL, REPEAT, Graph, Node
from pegainfer.ir.kernel import fused_ops, is_view
from pegainfer.ir.registry import COLLECTIVE, get_op
from pegainfer.ir.types import TensorType
from pegainfer.passes.manager import PassLog
from pegainfer.passes.rewrite import kernel_attrs


def is_collective(node: Node) -> bool:
    """A collective op (all_reduce, all_gather, ...): NCCL runs it between the kernels, it is never one."""
    return node.op not in (KERNEL, REPEAT) and get_op(node.op).category == COLLECTIVE


def form_kernels(graph: Graph, log: PassLog) -> Graph:
    """Makes every op left unfused a kernel of its own (views stay views: they move no data; collectives stay
    nodes, which NCCL runs between the kernels)."""
    for g in graph.all_graphs():
        nodes = []
        for node in g.nodes:
            if node.op in (KERNEL, REPEAT) or is_view(node) or is_collective(node):
                nodes.append(node)
                if is_collective(node):
                    log.note(f"{g.name}: %{node.name} ({node.op}) stays a collective node, run by NCCL")
                continue
            nodes.append(Node(KERNEL, node.inputs, node.outputs, node.output_types,
                              kernel_attrs(g, node.op, [node], list(node.outputs), replaced=[node])))
            log.note(f"{g.name}: %{node.name} ({node.op}) is a kernel of its own")
        g.nodes = nodes
    return graph


@dataclass(frozen=True)
class KernelInfo:
    graph: str
    name: str
    kind: str
    ops: tuple[str, ...]
    inputs: tuple[tuple[str, TensorType], ...]
    outputs: tuple[tuple[str, TensorType], ...]
    launches: int  # per step: the layer count for a kernel of a repeated body

    def as_json(self) -> dict:
        return {"graph": self.graph, "name": self.name, "kind": self.kind, "ops": list(self.ops),
                "launches_per_step": self.launches,
                "inputs": [{"name": n, "type": str(t)} for n, t in self.inputs],
                "outputs": [{"name": n, "type": str(t)} for n, t in self.outputs]}


def list_kernels(graph: Graph) -> list[KernelInfo]:
    """Every kernel of a lowered graph in launch order, bodies where their repeat runs."""
    found: list[KernelInfo] = []
    for node in graph.nodes:
        if node.op == REPEAT:
            body = graph.subgraphs[node.attrs["body"]]
            found += [_info(body, n, node.attrs["count"]) for n in body.nodes if n.op == KERNEL]
        elif node.op == KERNEL:
            found.append(_info(graph, node, 1))
    return found


def _info(graph: Graph, node: Node, launches: int) -> KernelInfo:
    types = graph.value_types()
    return KernelInfo(graph.name, node.name, node.attrs["kind"], tuple(fused_ops(node)),
                      tuple((v, types[v]) for v in node.inputs), tuple(zip(node.outputs, node.output_types)),
                      launches)


@dataclass(frozen=True)
class CollectiveInfo:
    graph: str
    name: str
    op: str
    input: TensorType
    output: TensorType
    launches: int  # per step, like KernelInfo's

    def describe(self) -> str:
        """What it reads (this rank's part) and writes (every rank's combined)."""
        return f"{self.op}({self.input}) -> {self.output}"


def list_collectives(graph: Graph) -> list[CollectiveInfo]:
    """Every collective node of a lowered graph in step order, bodies where their repeat runs."""
    found: list[CollectiveInfo] = []
    for node in graph.nodes:
        if node.op == REPEAT:
            body = graph.subgraphs[node.attrs["body"]]
            found += [_collective(body, n, node.attrs["count"]) for n in body.nodes if is_collective(n)]
        elif is_collective(node):
            found.append(_collective(graph, node, 1))
    return found


def _collective(graph: Graph, node: Node, launches: int) -> CollectiveInfo:
    return CollectiveInfo(graph.name, node.name, node.op, graph.value_types()[node.inputs[0]], node.output_types[0],
                          launches)


def kernels_per_layer(graph: Graph) -> dict[str, float]:
    """body name -> kernels it launches per decoder layer (a body may hold several layers: ir/layers.py)."""
    layers = {n.attrs["body"]: n.attrs.get("layers", 1) for n in graph.nodes if n.op == REPEAT}
    return {name: sum(n.op == KERNEL for n in body.nodes) / layers.get(name, 1)
            for name, body in graph.subgraphs.items()}


def format_kernels(graph: Graph) -> str:
    """The kernel table `pegainfer inspect --show kernels` prints: each kernel's name (what `--kernel` takes), its
    kind (the fused ops' pattern, which picks its template), launches per step, what it fuses, the dtypes it
    reads (its operands', in order: an FP8 weight shows as f8e4m3) and what it writes."""
    kernels = list_kernels(graph)
    per_layer = kernels_per_layer(graph)
    launches = sum(k.launches for k in kernels)
    width = max([len("name"), *(len(k.name) for k in kernels)])
    lines = [f"{graph.name}: {launches} kernel launches per step; per layer: "
             + ", ".join(f"{n:g} kernels in {body}" for body, n in per_layer.items()),
             "Decode steps (tokens = batch) and prefill steps (tokens = prompt tokens) launch the same kernels; "
             "shapes are symbolic.",
             f"{'#':>3}  {'graph':<14} {'name':<{width}} {'kind':<30} {'x':>3}  fuses (reads) -> writes"]
    for index, k in enumerate(kernels, start=1):
        reads = ", ".join(dict.fromkeys(t.dtype.name for _, t in k.inputs))
        writes = ", ".join(f"{name}:{t}" for name, t in k.outputs)
        lines.append(f"{index:>3}  {k.graph:<14} {k.name:<{width}} {k.kind:<30} {k.launches:>3}  "
                     f"{'+'.join(k.ops)} ({reads}) -> {writes}")
    collectives = list_collectives(graph)
    if collectives:
        lines.append(f"Collectives between the kernels (NCCL's, not kernels): "
                     f"{sum(c.launches for c in collectives)} per step")
        lines += [f"{index:>3}  {c.graph:<14} {c.name:<{width}} {c.op:<30} {c.launches:>3}  {c.describe()}"
                  for index, c in enumerate(collectives, start=1)]
    return "\n".join(lines) + "\n"
