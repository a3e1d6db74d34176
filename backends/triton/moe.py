"""Planning the mixture-of-experts kernels (kernels/moe.py): routing, and the experts' two launches over a float32
scratch of [tokens, K x moe_intermediate] between them."""

from pegainfer.backends.spec import GridDim, KernelSpec, VariantSpec
from pegainfer.backends.planning import static_layout
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.types import TensorType

ACT_CODES = {"silu": 1, "gelu_tanh": 2}  # as kernels/gemm.py's
BLOCK_N, BLOCK_K = 32, 128


def plan_moe_route(graph: Graph, node: Node) -> KernelSpec:
    (route,) = node.attrs["nodes"]
    types = graph.value_types() | dict(zip(route.outputs, route.output_types))
    rows, experts = types[route.inputs[0]].shape
    k = route.attrs["k"]
    p = Params(types, static_layout(graph))
    for name, value in (("logits_ptr", route.inputs[0]), ("weights_ptr", route.outputs[0]),
                        ("ids_ptr", route.outputs[1])):
        p.tensor(name, value)
    for name, value in (("stride_logits", route.inputs[0]), ("stride_weights", route.outputs[0]),
                        ("stride_ids", route.outputs[1])):
        p.stride(name, value)
    constexprs = dict(E=experts, K=k, BLOCK_E=next_pow2(experts), BLOCK_K=next_pow2(k),
                      NORMALIZE=bool(route.attrs["normalize"]))
    route_launch = launch("moe.py", "moe_route_kernel", p, constexprs, (GridDim((rows,)),), num_warps=1)
    return kernel_spec(graph, node, rows, [VariantSpec("default", None, [route_launch])])


def plan_moe_experts(graph: Graph, node: Node) -> KernelSpec:
    (moe,) = node.attrs["nodes"]
    x, weights, ids, gate_up, down = moe.inputs
    types = graph.value_types() | dict(zip(moe.outputs, moe.output_types))
    rows, hidden = types[x].shape
    k, experts = types[ids].shape[1], moe.attrs["experts"]
    inter = types[gate_up].shape[0] // (2 * experts)
    scratch = {"moe.hidden": TensorType(dtype_from_name("f32"), (rows, k * inter))}
    types = types | scratch
    layout = static_layout(graph) | {name: (t.shape[1], 0) for name, t in scratch.items()}
    block_k = lambda n: min(BLOCK_K, max(16, next_pow2(n)))  # noqa: E731
    gate = Params(types, layout)
    for name, value in (("x_ptr", x), ("ids_ptr", ids), ("w_ptr", gate_up), ("hidden_ptr", "moe.hidden")):
        gate.tensor(name, value)
    for name, value in (("stride_x", x), ("stride_ids", ids), ("stride_hidden", "moe.hidden")):
        gate.stride(name, value)
    gate_launch = launch("moe.py", "moe_gate_up_kernel", gate,
                         dict(H=hidden, INTER=inter, K=k, ACT=ACT_CODES[moe.attrs["act"]], BLOCK_N=BLOCK_N,
                              BLOCK_K=block_k(hidden)),
                         (GridDim((rows, k)), GridDim((inter,), BLOCK_N)))
    down_p = Params(types, layout)
    for name, value in (("hidden_ptr", "moe.hidden"), ("weights_ptr", weights), ("ids_ptr", ids), ("w_ptr", down),
                        ("out_ptr", moe.outputs[0])):
        down_p.tensor(name, value)
    for name, value in (("stride_hidden", "moe.hidden"), ("stride_weights", weights), ("stride_ids", ids),
                        ("stride_out", moe.outputs[0])):
        down_p.stride(name, value)
    down_launch = launch("moe.py", "moe_down_kernel", down_p,
                         dict(H=hidden, INTER=inter, K=k, BLOCK_N=BLOCK_N, BLOCK_K=block_k(inter)),
                         (GridDim((rows,)), GridDim((hidden,), BLOCK_N)))
    spec = kernel_spec(graph, node, rows, [VariantSpec("default", None, [gate_launch, down_launch])])
    spec.scratch = {name: (t.dtype.name, t.shape) for name, t in scratch.items()}
    return spec
