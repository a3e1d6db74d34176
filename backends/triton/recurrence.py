"""Planning the linear-attention recurrences (kernels/linear_attention.py): the causal convolution, a program per
(sequence, channel block, token block); the gated delta rule as two launches of one variant, the recurrent kernel
over the step's leading decode sequences and the chunked kernel over the prompt chunks after them."""

from pegainfer.backends.planning import static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, VariantSpec
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.ops.linear_attention import L2_EPS

CONV_BLOCK_C, CONV_BLOCK_T = 128, 16
DELTA_CHUNK = 32  # tokens of a chunk of the chunked form: its system is CHUNK x CHUNK
DELTA_BLOCK_V = 64  # value columns of a program's state tile


def plan_causal_conv1d(graph: Graph, node: Node) -> KernelSpec:
    (conv,) = node.attrs["nodes"]
    x, weight, state, slots, starts, qlens, ctx = conv.inputs
    types = graph.value_types() | dict(zip(conv.outputs, conv.output_types))
    channels, width = types[weight].shape
    assert width - 1 <= CONV_BLOCK_T, f"{node.name}: a kernel of {width} taps reaches past its first token block"
    p = Params(types, static_layout(graph))
    for name, value in (("x_ptr", x), ("w_ptr", weight), ("state_ptr", state), ("slots_ptr", slots),
                        ("starts_ptr", starts), ("qlens_ptr", qlens), ("ctx_ptr", ctx), ("out_ptr", conv.outputs[1])):
        p.tensor(name, value)
    p.stride("stride_x", x)
    p.stride("stride_out", conv.outputs[1])
    constexprs = dict(CHANNELS=channels, WIDTH=width, SILU=conv.attrs.get("activation") == "silu",
                      BLOCK_C=min(CONV_BLOCK_C, next_pow2(channels)), BLOCK_T=CONV_BLOCK_T)
    grid = (GridDim(("batch",)), GridDim((channels,), constexprs["BLOCK_C"]),
            GridDim(("max_query_len",), CONV_BLOCK_T))
    row_symbol = types[x].shape[0]
    return kernel_spec(graph, node, row_symbol, [VariantSpec("default", None, [
        launch("linear_attention.py", "causal_conv1d_kernel", p, constexprs, grid, num_warps=4)])])


def plan_gated_delta_rule(graph: Graph, node: Node) -> KernelSpec:
    (delta,) = node.attrs["nodes"]
    q, k, v, g, beta, state, slots, starts, qlens, ctx = delta.inputs
    types = graph.value_types() | dict(zip(delta.outputs, delta.output_types))
    key_heads, key_dim = types[q].shape[1:]
    value_heads, value_dim = types[v].shape[1:]
    block_v = max(16, min(DELTA_BLOCK_V, next_pow2(value_dim)))
    constexprs = dict(KEY_HEADS=key_heads, VALUE_HEADS=value_heads, K=key_dim, V=value_dim,
                      BK=max(16, next_pow2(key_dim)), BV=block_v, SCALE=float(delta.attrs["scale"]),
                      L2NORM=bool(delta.attrs.get("l2norm", True)), L2_EPS=L2_EPS)
    blocks = GridDim((value_dim,), block_v)

    def params(chunked: bool) -> Params:
        p = Params(types, static_layout(graph))
        for name, value in (("q_ptr", q), ("k_ptr", k), ("v_ptr", v), ("g_ptr", g), ("beta_ptr", beta),
                            ("state_ptr", state), ("slots_ptr", slots), ("starts_ptr", starts), ("qlens_ptr", qlens),
                            ("ctx_ptr", ctx), ("out_ptr", delta.outputs[1])):
            p.tensor(name, value)
        p.dim("decode_seqs", "decode_seqs")
        if chunked:
            p.dim("batch", "batch")
        for name, value in (("stride_q", q), ("stride_k", k), ("stride_v", v), ("stride_g", g),
                            ("stride_beta", beta), ("stride_out", delta.outputs[1])):
            p.stride(name, value)
        return p
    recurrent = launch("linear_attention.py", "gated_delta_rule_recurrent_kernel", params(False), constexprs,
                       (GridDim(("decode_seqs",)), GridDim((value_heads,)), blocks), num_warps=4)
    chunked = launch("linear_attention.py", "gated_delta_rule_chunked_kernel", params(True),
                     constexprs | {"CHUNK": DELTA_CHUNK}, (GridDim(("prefill_seqs",)), GridDim((value_heads,)), blocks),
                     num_warps=4)
    return kernel_spec(graph, node, types[q].shape[0], [VariantSpec("default", None, [recurrent, chunked])])
