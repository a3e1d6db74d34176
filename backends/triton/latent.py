"""Planning latent attention (kernels/latent_attention.py): the latent cache write, a program per token; the
attention, a program per (sequence, head tile, query tile) whose rows are a few queries times the heads that share
the one cached latent head, and for steps holding a prompt chunk kernels/latent_prefill.py's 64-row programs, one
per 256 value columns; the per-head GEMM, a program per (row tile, head, column tile); and plan_rope, a standalone rope
of the rope parts (a program per token)."""

from pegainfer.backends.planning import PlanOptions, static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, VariantSpec
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.errors import PegainferError
from pegainfer.ir.graph import Graph, Node

TEMPLATE = "latent_attention.py"
TILE_ROWS = 16  # query rows (queries x heads) of an attention program at the least: the tensor cores' M
MAX_HEAD_TILE = 64  # heads of one attention program at the most: more heads take more programs
LATENT_TILE = 16384  # cached values (keys x latent width) of a key tile at the most: 32 keys of a 512-wide latent
MAX_LATENT = 512  # an attention program holds its rows' whole latent (queries, output; 144 KiB shared at 64 heads)
HEAD_TILE_M, HEAD_TILE_N, HEAD_TILE_K = 64, 64, 64  # head_linear's tiles at the most
PREFILL_ROWS, PREFILL_QUERIES = 64, 16  # kernels/latent_prefill.py's rows a program; from this max_query_len on
PREFILL_C, PREFILL_V, PREFILL_KV = 64, 256, 64  # its score chunks, value chunk and key tile
PREFILL_STAGES = 1  # its key loop unpipelined: two stages of the 9 score chunks want 248 KiB of shared memory


def _types(graph: Graph, inner: Node) -> dict:
    return graph.value_types() | dict(zip(inner.outputs, inner.output_types))


def _head_stride(graph: Graph, layout: dict, value: str, node: Node) -> int:
    """The elements between a [tokens, heads, D] value's heads: a split of the last dim keeps its source's, any
    other value's inner dims are contiguous. The kernels take it, and the row stride, as constexprs."""
    if layout[value][0] is None:
        raise PegainferError(f"kernel {node.name}: {value} has no static row stride")
    producers = {out: n for n in graph.nodes for out in n.outputs}
    while value in producers and producers[value].op == "split":
        value = producers[value].inputs[0]
    return graph.value_types()[value].shape[2]


def plan_latent_write(graph: Graph, node: Node) -> KernelSpec:
    (write,) = node.attrs["nodes"]
    cache, latent, rope_key, slots = write.inputs
    types = _types(graph, write)
    width, rope = types[latent].shape[1], types[rope_key].shape[1]
    p = Params(types, static_layout(graph))
    for name, value in (("cache_ptr", cache), ("latent_ptr", latent), ("rope_ptr", rope_key), ("slots_ptr", slots)):
        p.tensor(name, value)
    p.stride("stride_latent", latent)
    p.stride("stride_rope", rope_key)
    constexprs = dict(L=width, R=rope, BLOCK_L=min(MAX_LATENT, next_pow2(width)), BLOCK_R=next_pow2(rope))
    row_symbol = types[latent].shape[0]
    tokens = launch(TEMPLATE, "latent_write_kernel", p, constexprs, (GridDim((row_symbol,)),), num_warps=1)
    return kernel_spec(graph, node, row_symbol, [VariantSpec("default", None, [tokens])])


def plan_latent_attention(graph: Graph, node: Node, options: PlanOptions) -> KernelSpec:
    (attention,) = node.attrs["nodes"]
    q, q_rope, cache, tables, starts, q_lens, ctx_lens = attention.inputs
    types = _types(graph, attention)
    out = attention.outputs[0]
    tokens, heads, width = types[q].shape
    rope = types[q_rope].shape[2]
    if width > MAX_LATENT:
        raise PegainferError(f"kernel {node.name}: a latent of {width} values is wider than {MAX_LATENT}")
    layout = static_layout(graph)
    heads_apart = dict(HEAD_Q=_head_stride(graph, layout, q, node), HEAD_ROPE=_head_stride(graph, layout, q_rope, node),
                       HEAD_OUT=_head_stride(graph, layout, out, node))
    p = Params(types, layout)
    for name, value in (("q_ptr", q), ("q_rope_ptr", q_rope), ("cache_ptr", cache), ("tables_ptr", tables),
                        ("starts_ptr", starts), ("q_lens_ptr", q_lens), ("ctx_lens_ptr", ctx_lens),
                        ("out_ptr", out)):
        p.tensor(name, value)
    for name, value in (("stride_q", q), ("stride_rope", q_rope), ("stride_out", out), ("stride_tables", tables)):
        p.stride(name, value)
    block_h = min(MAX_HEAD_TILE, next_pow2(heads))
    block_l = max(16, next_pow2(width))
    constexprs = dict(SCALE=float(attention.attrs["scale"]), HEADS=heads, L=width, R=rope,
                      CACHE_BLOCK=options.block_size, BLOCK_L=block_l, BLOCK_R=max(16, next_pow2(rope)),
                      BLOCK_H=block_h, BLOCK_Q=max(1, TILE_ROWS // block_h),
                      BLOCK_KV=max(16, min(64, LATENT_TILE // block_l)), UPCAST_DOT=False, **heads_apart)
    batch = types[starts].shape[0]
    grid = (GridDim((batch,)), GridDim((heads,), block_h), GridDim(("max_query_len",), constexprs["BLOCK_Q"]))
    tiles = launch(TEMPLATE, "latent_attention_kernel", p, constexprs, grid, num_warps=4 if block_l <= 128 else 8)
    prefill = _prefill_variant(p, constexprs, batch, heads, width)
    return kernel_spec(graph, node, batch, [prefill, VariantSpec("default", None, [tiles])])


def _prefill_variant(p: Params, decode: dict, batch, heads: int, width: int) -> VariantSpec:
    """kernels/latent_prefill.py for steps holding a prompt chunk (and any decode rows beside it)."""
    block_q = max(1, PREFILL_ROWS // decode["BLOCK_H"])
    block_v = min(PREFILL_V, decode["BLOCK_L"])
    chunks = -(-width // block_v)
    keep = ("SCALE", "HEADS", "L", "R", "CACHE_BLOCK", "BLOCK_R", "BLOCK_H", "HEAD_Q", "HEAD_ROPE", "HEAD_OUT",
            "UPCAST_DOT")
    constexprs = {key: decode[key] for key in keep} | dict(
        BLOCK_C=min(PREFILL_C, decode["BLOCK_L"]), BLOCK_V=block_v, BLOCK_Q=block_q, BLOCK_KV=PREFILL_KV,
        CHUNKS=chunks)
    grid = (GridDim((batch,)), GridDim((heads,), decode["BLOCK_H"]), GridDim(("max_query_len",), block_q, chunks))
    tiles = launch("latent_prefill.py", "latent_prefill_kernel", p, constexprs, grid, 8, PREFILL_STAGES)
    return VariantSpec(f"prefill_{PREFILL_ROWS}x{block_v}", None, [tiles], min_sizes={"max_query_len": PREFILL_QUERIES})


def plan_head_linear(graph: Graph, node: Node) -> KernelSpec:
    (linear,) = node.attrs["nodes"]
    x, weight = linear.inputs
    out = linear.outputs[0]
    types = _types(graph, linear)
    rows, heads, k = types[x].shape
    n = types[out].shape[2]
    if types[weight].dtype.name.startswith("f8"):
        raise PegainferError(f"kernel {node.name}: an FP8 head_linear weight has no Triton template")
    layout = static_layout(graph)
    heads_apart = dict(HEAD_X=_head_stride(graph, layout, x, node), HEAD_OUT=_head_stride(graph, layout, out, node))
    p = Params(types, layout)
    for name, value in (("x_ptr", x), ("w_ptr", weight), ("out_ptr", out)):
        p.tensor(name, value)
    p.dim("M", rows)
    p.stride("stride_x", x)
    p.stride("stride_out", out)
    block_m = HEAD_TILE_M if not isinstance(rows, int) else max(16, min(HEAD_TILE_M, next_pow2(rows)))
    block_n = max(16, min(HEAD_TILE_N, next_pow2(n)))
    block_k = max(16, min(HEAD_TILE_K, next_pow2(k)))
    constexprs = dict(HEADS=heads, N=n, K=k, TRANSPOSED=bool(linear.attrs.get("transposed", False)),
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST_DOT=False, **heads_apart)
    grid = (GridDim((rows,), block_m), GridDim((heads,)), GridDim((n,), block_n))
    variants = []
    if not isinstance(rows, int):  # decode steps: a 16-row tile wastes less of the weights' reads
        small = launch(TEMPLATE, "head_linear_kernel", p, constexprs | {"BLOCK_M": 16},
                       (GridDim((rows,), 16), *grid[1:]), num_warps=4)
        variants.append(VariantSpec("rows_16", 16, [small]))
    tiles = launch(TEMPLATE, "head_linear_kernel", p, constexprs, grid, num_warps=4)
    return kernel_spec(graph, node, rows, variants + [VariantSpec(f"rows_{block_m}", None, [tiles])])


def plan_rope(graph: Graph, node: Node) -> KernelSpec:
    """A standalone rope (the latent attention's query and key rope parts: no cache write follows them)."""
    (rope,) = node.attrs["nodes"]
    x, positions = rope.inputs
    out = rope.outputs[0]
    types = _types(graph, rope)
    rows, heads, dims = types[x].shape
    rot = int(rope.attrs.get("rotary_dim", 0)) or dims
    layout = static_layout(graph)
    heads_apart = dict(HEAD_X=_head_stride(graph, layout, x, node), HEAD_OUT=_head_stride(graph, layout, out, node))
    p = Params(types, layout)
    for name, value in (("x_ptr", x), ("pos_ptr", positions), ("out_ptr", out)):
        p.tensor(name, value)
    p.stride("stride_x", x)
    p.stride("stride_out", out)
    scaling = rope.attrs.get("scaling")
    kind = {None: 0, "linear": 1, "by_wavelength": 2, "yarn": 3}[scaling[0] if scaling else None]
    numbers = [float(v) for v in (scaling or ())[1:]] + [1.0] * 4
    factor, low, high, last = numbers[:4]
    if kind == 3 and high <= low:
        high = low + 0.001  # as rope_inv_freq: a ramp of no width
    constexprs = dict(HEADS=heads, D=dims, ROT=rot, INTERLEAVED=bool(rope.attrs.get("interleaved", False)),
                      BLOCK_H=next_pow2(heads), BLOCK_HALF=next_pow2(rot // 2),
                      BLOCK_REST=next_pow2(max(1, dims - rot)),
                      THETA=float(rope.attrs["theta"]), SCALING=kind, FACTOR=factor, LOW=low, HIGH=high,
                      ORIGINAL=last if kind == 2 else 1.0, MAGNITUDE=last if kind == 3 else 1.0, **heads_apart)
    tokens = launch(TEMPLATE, "rope_rows_kernel", p, constexprs, (GridDim((rows,)),), num_warps=1)
    return kernel_spec(graph, node, rows, [VariantSpec("default", None, [tokens])])
