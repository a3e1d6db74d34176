"""Planning the mixture-of-experts kernels: routing (kernels/moe.py), and the experts in two variants by the step's
rows: per-pair GEMVs for decode (kernels/moe.py, two launches over a float32 scratch of [tokens, K x
moe_intermediate]), and grouped tensor-core GEMMs over the pairs sorted by expert for prefill
(kernels/moe_grouped.py: sort, gate/up, down, sum). A node holding some of the routed experts only (expert
parallelism) passes its first expert and their count, so that pairs routed elsewhere are skipped."""

from dataclasses import dataclass
from inspect import Parameter, signature

from pegainfer.backends.spec import GridDim, KernelSpec, LaunchSpec, VariantSpec
from pegainfer.backends.planning import static_layout
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.ops.moe import _infer_route, held_experts
from pegainfer.ir.types import TensorType

ACT_CODES = {"silu": 1, "gelu_tanh": 2}  # as kernels/gemm.py's
BLOCK_N, BLOCK_K = 32, 128  # the GEMV path's column and K tiles
GEMV_MAX_ROWS = 64  # at most this many rows take a pair's GEMV (gemv_rows), or the grouped GEMMs a program a pair
GROUPED_M, GROUPED_N, GROUPED_K = 64, 64, 64  # the grouped GEMMs' tiles: pairs, columns, K (at most)
GROUPED_WARPS, GROUPED_STAGES = 4, 3
TILE_PROGRAMS = 2  # the grouped GEMMs' programs a column tile, per GROUPED_M pairs of the step: tiles are at most
# those plus one an expert, so a program takes a few tiles when a step has few pairs an expert, about one when many
SORT_EXPERTS, SORT_PAIRS = 8, 1024  # the experts one program of the sort places; the pairs it reads at once
SORT_WARPS = 4
SUM_N = 256  # the columns of a program summing a token's K rows
ROUTE_DEFAULTS = {name: p.default for name, p in signature(_infer_route).parameters.items()
                  if p.default is not Parameter.empty}


def plan_moe_route(graph: Graph, node: Node) -> KernelSpec:
    """One program a token; the attributes the node leaves out take _infer_route's defaults."""
    (route,) = node.attrs["nodes"]
    attrs = ROUTE_DEFAULTS | route.attrs
    types = graph.value_types() | dict(zip(route.outputs, route.output_types))
    rows, experts = types[route.inputs[0]].shape
    bias = route.inputs[1] if len(route.inputs) > 1 else None
    p = Params(types, static_layout(graph))
    for name, value in (("logits_ptr", route.inputs[0]), ("bias_ptr", bias), ("weights_ptr", route.outputs[0]),
                        ("ids_ptr", route.outputs[1])):
        p.tensor(name, value)
    for name, value in (("stride_logits", route.inputs[0]), ("stride_weights", route.outputs[0]),
                        ("stride_ids", route.outputs[1])):
        p.stride(name, value)
    groups = attrs["groups"] or 1
    per_group = experts // groups
    constexprs = dict(E=experts, K=attrs["k"], G=groups, S=per_group, BLOCK_G=next_pow2(groups),
                      BLOCK_S=next_pow2(per_group), BLOCK_K=next_pow2(attrs["k"]),
                      TOPK_GROUP=attrs["topk_group"] if attrs["groups"] else 1,
                      GROUP_TOP2=attrs["group_score"] == "top2", SIGMOID=attrs["scoring"] == "sigmoid",
                      NORMALIZE=bool(attrs["normalize"]), SCALE=float(attrs["scale"]), BIAS=bias is not None)
    route_launch = launch("moe.py", "moe_route_kernel", p, constexprs, (GridDim((rows,)),), num_warps=1)
    return kernel_spec(graph, node, rows, [VariantSpec("default", None, [route_launch])])


@dataclass(frozen=True)
class Experts:
    """What both variants of a moe_experts kernel read off its node."""
    x: str
    weights: str
    ids: str
    gate_up: str
    down: str
    out: str
    rows: str  # the row symbol
    hidden: int
    inter: int
    k: int
    experts: int  # the experts the weights hold
    first: int  # the first of them among the routed ones
    routed: int  # the experts the router picks among
    act: int
    gate_up_scale: str | None  # FP8 experts' scales (None: the weights are in the model's dtype)
    down_scale: str | None
    block: tuple[int, int]  # the rows and columns one scale covers (FP8 only)

    def fp8(self, scale: str | None) -> dict:
        return dict(FP8=scale is not None, BR=self.block[0], BC=self.block[1])

    def held(self) -> dict:
        """The constexprs that tell the kernels which experts this node holds."""
        return dict(FIRST=self.first, E=self.experts)

    @property
    def partial(self) -> bool:
        return self.experts < self.routed


def plan_moe_experts(graph: Graph, node: Node) -> KernelSpec:
    """The per-pair GEMVs up to gemv_rows rows, the grouped GEMMs above: a program a pair up to GEMV_MAX_ROWS
    (decode steps, where a tile holds a pair or two), then a few tiles a program (prefill)."""
    (moe,) = node.attrs["nodes"]
    x, weights, ids, gate_up, down, *scales = moe.inputs
    types = graph.value_types() | dict(zip(moe.outputs, moe.output_types))
    rows, hidden = types[x].shape
    k, routed, held = types[ids].shape[1], moe.attrs["experts"], held_experts(types[down], hidden)
    gate_up_scale, down_scale = scales or (None, None)
    e = Experts(x, weights, ids, gate_up, down, moe.outputs[0], rows, hidden, types[down].shape[1], k, held,
                moe.attrs.get("first_expert", 0), routed, ACT_CODES[moe.attrs["act"]], gate_up_scale, down_scale,
                tuple(moe.attrs.get("block") or (1, 1)))
    f32, i32 = dtype_from_name("f32"), dtype_from_name("i32")
    scratch = {"moe.hidden": TensorType(f32, (rows, k * e.inter)),
               "moe.act": TensorType(types[x].dtype, (rows, k * e.inter)),
               "moe.partial": TensorType(f32, (rows, k * hidden)),
               "moe.pairs": TensorType(i32, (rows, pair_slots(k, held, gemv_rows(k, routed)))),
               "moe.tiles": TensorType(i32, (rows, k + 1))}
    types = types | scratch
    layout = static_layout(graph) | {name: (t.shape[1], 0) for name, t in scratch.items()}
    per_pair = GridDim((rows, k))  # a program a pair: every tile has its own, however few pairs share an expert
    shared = GridDim((rows, k), GROUPED_M, TILE_PROGRAMS)  # a few tiles a program, where tiles are mostly full
    variants = [VariantSpec("gemv_1", gemv_rows(k, routed), _gemv_launches(e, types, layout)),
                VariantSpec("grouped_pairs", GEMV_MAX_ROWS, _grouped_launches(e, types, layout, per_pair)),
                VariantSpec(f"grouped_{GROUPED_M}", None, _grouped_launches(e, types, layout, shared))]
    spec = kernel_spec(graph, node, rows, variants)
    spec.scratch = {name: (t.dtype.name, t.shape) for name, t in scratch.items()}
    return spec


def gemv_rows(k: int, experts: int) -> int:
    """The most rows the GEMVs serve: while pairs seldom share an expert (a quarter of a pair an expert) each reads
    its expert's weights about once either way; past it the grouped GEMMs read an expert once for all its pairs
    (measured with 64 experts, k = 6: 1.04x at 8 rows, 1.2x at 32, 2x at 64:
    docs/benchmarks/2026-12-04-latent-moe.md). `experts`: the routed ones, a rank's share of the pairs being
    spread over its share of them alike."""
    return max(1, min(GEMV_MAX_ROWS, experts // (4 * k)))


def pair_slots(k: int, experts: int, gemv_max: int) -> int:
    """moe.pairs' entries a row: the padded pairs are at most tokens x k + experts x (GROUPED_M - 1) (each expert
    with a pair pads its last tile), and at most tokens x k x GROUPED_M (each pair pads a tile of its own);
    `experts`: those the node holds, the only ones given tiles. The
    grouped variant serves more than `gemv_max` rows only, and the runtime sizes scratch for its largest step,
    so the first bound is met by a share of the experts' padding a row."""
    return min(k * GROUPED_M, k + -(-experts * (GROUPED_M - 1) // (gemv_max + 1)))


def _block(n: int, most: int) -> int:
    """A tile side for n: a power of two from 16 (tl.dot's least) to `most`."""
    return min(most, max(16, next_pow2(n)))


def _gemv_launches(e: Experts, types: dict, layout: dict) -> list[LaunchSpec]:
    gate = Params(types, layout)
    for name, value in (("x_ptr", e.x), ("ids_ptr", e.ids), ("w_ptr", e.gate_up), ("scale_ptr", e.gate_up_scale),
                        ("hidden_ptr", "moe.hidden")):
        gate.tensor(name, value)
    for name, value in (("stride_x", e.x), ("stride_ids", e.ids), ("stride_hidden", "moe.hidden")):
        gate.stride(name, value)
    gate_launch = launch("moe.py", "moe_gate_up_kernel", gate,
                         dict(H=e.hidden, INTER=e.inter, K=e.k, ACT=e.act, BLOCK_N=BLOCK_N,
                              BLOCK_K=_block(e.hidden, BLOCK_K), **e.fp8(e.gate_up_scale), **e.held()),
                         (GridDim((e.rows, e.k)), GridDim((e.inter,), BLOCK_N)))
    down = Params(types, layout)
    for name, value in (("hidden_ptr", "moe.hidden"), ("weights_ptr", e.weights), ("ids_ptr", e.ids),
                        ("w_ptr", e.down), ("scale_ptr", e.down_scale), ("out_ptr", e.out)):
        down.tensor(name, value)
    for name, value in (("stride_hidden", "moe.hidden"), ("stride_weights", e.weights), ("stride_ids", e.ids),
                        ("stride_out", e.out)):
        down.stride(name, value)
    # a program a token and down_n columns: 256 programs a token from 2048 columns on, so one token fills the SMs
    down_n = max(8, min(BLOCK_N, next_pow2(e.hidden) // 256)) if e.hidden >= 2048 else BLOCK_N
    down_launch = launch("moe.py", "moe_down_kernel", down,
                         dict(H=e.hidden, INTER=e.inter, K=e.k, BLOCK_N=down_n, BLOCK_K=_block(e.inter, BLOCK_K),
                              **e.fp8(e.down_scale), **e.held()),
                         (GridDim((e.rows,)), GridDim((e.hidden,), down_n)))
    return [gate_launch, down_launch]


def _grouped_launches(e: Experts, types: dict, layout: dict, tiles: GridDim) -> list[LaunchSpec]:
    """Sort, gate/up, down, sum; `tiles`: the programs that share a GEMM's tiles (beside its column tiles)."""
    sort = Params(types, layout)
    for name, value in (("ids_ptr", e.ids), ("pairs_ptr", "moe.pairs"), ("tiles_ptr", "moe.tiles")):
        sort.tensor(name, value)
    sort.dim("M", e.rows)
    sort.stride("stride_ids", e.ids)
    owned = min(SORT_EXPERTS, next_pow2(e.experts))
    sort_launch = launch("moe_grouped.py", "moe_sort_kernel", sort,
                         dict(K=e.k, BLOCK_E=next_pow2(e.experts), EXPERTS=owned, BLOCK_P=SORT_PAIRS,
                              BLOCK_M=GROUPED_M, BLOCK_T=32, **e.held()), (GridDim((e.experts,), owned),),
                         SORT_WARPS)
    gate = Params(types, layout)
    for name, value in (("x_ptr", e.x), ("w_ptr", e.gate_up), ("scale_ptr", e.gate_up_scale),
                        ("pairs_ptr", "moe.pairs"), ("tiles_ptr", "moe.tiles"), ("hidden_ptr", "moe.act")):
        gate.tensor(name, value)
    for name, value in (("stride_x", e.x), ("stride_hidden", "moe.act")):
        gate.stride(name, value)
    gate_n = _block(e.inter, GROUPED_N)
    gate_launch = launch("moe_grouped.py", "moe_grouped_gate_up_kernel", gate,
                         dict(H=e.hidden, INTER=e.inter, K=e.k, ACT=e.act, BLOCK_M=GROUPED_M, BLOCK_N=gate_n,
                              BLOCK_K=_block(e.hidden, GROUPED_K), UPCAST_DOT=False, **e.fp8(e.gate_up_scale)),
                         (GridDim((e.inter,), gate_n), tiles), GROUPED_WARPS, GROUPED_STAGES)
    down = Params(types, layout)
    for name, value in (("hidden_ptr", "moe.act"), ("weights_ptr", e.weights), ("w_ptr", e.down),
                        ("scale_ptr", e.down_scale), ("pairs_ptr", "moe.pairs"), ("tiles_ptr", "moe.tiles"),
                        ("partial_ptr", "moe.partial")):
        down.tensor(name, value)
    for name, value in (("stride_hidden", "moe.act"), ("stride_weights", e.weights),
                        ("stride_partial", "moe.partial")):
        down.stride(name, value)
    down_n = _block(e.hidden, GROUPED_N)
    down_launch = launch("moe_grouped.py", "moe_grouped_down_kernel", down,
                         dict(H=e.hidden, INTER=e.inter, K=e.k, BLOCK_M=GROUPED_M, BLOCK_N=down_n,
                              BLOCK_K=_block(e.inter, GROUPED_K), UPCAST_DOT=False, **e.fp8(e.down_scale)),
                         (GridDim((e.hidden,), down_n), tiles), GROUPED_WARPS, GROUPED_STAGES)
    total = Params(types, layout)
    for name, value in (("partial_ptr", "moe.partial"), ("ids_ptr", e.ids), ("out_ptr", e.out)):
        total.tensor(name, value)
    for name, value in (("stride_partial", "moe.partial"), ("stride_ids", e.ids), ("stride_out", e.out)):
        total.stride(name, value)
    sum_n = min(SUM_N, next_pow2(e.hidden))
    sum_launch = launch("moe_grouped.py", "moe_sum_kernel", total,
                        dict(H=e.hidden, K=e.k, BLOCK_N=sum_n, PARTIAL=e.partial, **e.held()),
                        (GridDim((e.rows,)), GridDim((e.hidden,), sum_n)))
    return [sort_launch, gate_launch, down_launch, sum_launch]
