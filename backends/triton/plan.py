"""Planning: each kernel node of the kernel DAG -> the Triton launches that run it (a template specialised by
constexprs, or a generated row kernel), their parameter ABI, grid rule and row-count variants."""

from dataclasses import dataclass
from itertools import accumulate
from math import prod
from pathlib import Path

from pegainfer.backends.spec import GridDim, KernelSpec, LaunchSpec, Param, VariantSpec
from pegainfer.backends.triton import rowwise
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.kernel import fused_ops
from pegainfer.ir.ops.sampling import FIXED_ONE, GREEDY_BELOW, TOP_P_SLACK
from pegainfer.ir.step import uploaded
from pegainfer.ir.types import TensorType

KERNELS = Path(__file__).parent / "kernels"
SMALL_ROWS = 16  # up to this many rows a GEMM uses its decode-shaped tiles
SPLIT_KV = 16  # key slices per sequence for attention at small batch
PREFILL_QUERIES = 64  # attention takes prefill-shaped tiles when some sequence of the step brings this many queries
PREFILL_ROWS = 64  # query rows (queries x the heads sharing a KV head) in such a tile
TAIL_CHUNK = 4096  # vocabulary entries per program of the sampler tail's first launch
GEMV_PROGRAMS = 528  # a few-rows GEMV aims for at least this many programs: 4 per SM of an H100/H200
DECODE_TILE_ROWS = 16  # the tensor-core tiles of decode steps (up to SMALL_ROWS rows): their norm runs apart
# the rows a decode GEMM's norm launch writes for its tiles, in float32: the tiles round them to the weights' type
# as the fused prologue does (and Triton's interpreter, whose bf16 stores truncate, is not asked to)
NORMED = "gemm.normed_rows"
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the GEMMs' column tiles)
_TRITON_TYPES = {"bf16": "bf16", "f16": "fp16", "f32": "fp32", "i32": "i32", "i64": "i64"}


@dataclass(frozen=True)
class PlanOptions:
    block_size: int = 16  # KV-cache block size: a compile-time constant of the attention kernel
    split_kv_max_batch: int = 16  # up to this many sequences attention splits each one's keys over programs


def plan_kernel(graph: Graph, node: Node, options: PlanOptions) -> KernelSpec:
    ops = fused_ops(node)
    if "paged_attention" in ops:
        return _plan_attention(graph, node, options)
    if "kv_write" in ops:
        return _plan_rope_kv_write(graph, node)
    if ops in (["moe_route"], ["moe_experts"]):
        from pegainfer.backends.triton import moe  # it plans with this module's helpers
        return moe.plan_moe_route(graph, node) if ops == ["moe_route"] else moe.plan_moe_experts(graph, node)
    if "linear" in ops:
        return _plan_gemm(graph, node)
    if ops == ["embedding"]:
        return _plan_embedding(graph, node)
    if rowwise.supports(node.attrs["nodes"]):
        return _plan_row_kernel(graph, node)
    raise PegainferError(f"kernel {node.name} ({node.attrs['kind']}: {' + '.join(ops)}) has no Triton template")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def static_layout(graph: Graph) -> dict[str, tuple[int | None, int]]:
    """value -> (row stride in elements, or None when it depends on a step size; byte offset from the start of
    its allocation). Views keep their source's stride; a split moves the offset by the columns before it."""
    layout: dict[str, tuple[int | None, int]] = {}
    for name, t in graph.value_types().items():
        inner = t.shape[1:]
        layout[name] = (prod(inner) if all(isinstance(d, int) for d in inner) else None, 0)
    for node in graph.nodes:
        if node.op == "reshape":
            layout[node.outputs[0]] = layout[node.inputs[0]]
        elif node.op == "split":
            stride, offset = layout[node.inputs[0]]
            itemsize = node.output_types[0].dtype.itemsize
            for out, start in zip(node.outputs, [0, *accumulate(node.attrs["sizes"])]):
                layout[out] = (stride, offset + start * itemsize)
    return layout


class _Params:
    """Collects a launch's runtime parameters, and the constexprs that stand for absent pointers and for row
    strides, which are static for every value but the block tables (so the compiler sees them, and vectorises)."""

    def __init__(self, types: dict[str, TensorType], layout: dict[str, tuple[int | None, int]]) -> None:
        self.types, self.layout = types, layout
        self.params: list[Param] = []
        self.constexprs: dict = {}

    def tensor(self, name: str, value: str | None) -> None:
        if value is None:
            self.constexprs[name] = None
        else:
            aligned = self.layout[value][1] % 16 == 0
            self.params.append(Param(name, "tensor", value, "*" + _TRITON_TYPES[self.types[value].dtype.name],
                                     aligned))

    def stride(self, name: str, value: str | None) -> None:
        static = self.layout[value][0] if value is not None else 0
        if static is not None:
            self.constexprs[name] = static
        else:
            self.params.append(Param(name, "int", f"stride:{value}", "i32"))

    def dim(self, name: str, symbol: str) -> None:
        self.params.append(Param(name, "int", f"dim:{symbol}", "i32"))


def _launch(template: str, function: str, params: _Params, constexprs: dict, grid: tuple[GridDim, ...],
            num_warps: int = 4, num_stages: int = 2) -> LaunchSpec:
    grid = tuple(grid) + (GridDim(),) * (3 - len(grid))
    return LaunchSpec(function, template, (KERNELS / template).read_text(), params.params,
                      {**params.constexprs, **constexprs}, grid, num_warps, num_stages)


def _spec(graph: Graph, node: Node, row_symbol: str, variants: list[VariantSpec]) -> KernelSpec:
    return KernelSpec(graph.name, node.name, node.attrs["kind"], fused_ops(node), row_symbol, variants)


def _plan_gemm(graph: Graph, node: Node) -> KernelSpec:
    roles = gemm_roles(node)
    types = graph.value_types() | {o: t for n in node.attrs["nodes"] for o, t in zip(n.outputs, n.output_types)}
    row_symbol = types[roles["rows"]].shape[0] if roles["rows"] else types[roles["x"]].shape[0]
    n, k = roles["n"], types[roles["weight"]].shape[1]
    layout = static_layout(graph)
    variants, scratch = [], {}
    own_scratch = _split_scratch(n, k, roles) | {NORMED: TensorType(dtype_from_name("f32"), (SMALL_ROWS, k))}
    types, layout = types | own_scratch, layout | {name: (t.shape[-1], 0) for name, t in own_scratch.items()}
    for name, max_rows, block_m, block_n, block_k, warps, stages, function in _gemm_tiles(n, k, bool(roles["act"]),
                                                                                   roles["norm"] is not None):
        split = split_count(n, k, block_n, block_k) if function == "linear_split_kernel" else 1
        if function == "linear_split_kernel" and (roles["top_k"] is not None or split == 1):
            continue  # not before the sampler's tail (its own scratch), nor where one slice is enough
        assert function != "linear_split_kernel" or max_rows <= block_m, (name, max_rows)  # one row tile a plane
        launches, tile_roles = [], roles
        if roles["norm"] and block_m == DECODE_TILE_ROWS and roles["top_k"] is None:
            assert max_rows is not None and max_rows <= SMALL_ROWS, (name, max_rows)  # NORMED holds SMALL_ROWS rows
            launches.append(_norm_launch(types, layout, roles, row_symbol, k))
            tile_roles = roles | dict(x=NORMED, x2=None, rows=None, norm=None, sum=None)
            scratch[NORMED] = own_scratch[NORMED]
        if function == "linear_split_kernel":
            scratch |= {name: own_scratch[name] for name in ("gemm.split_part", "gemm.split_count")}
        tile = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
        launches.append(_gemm_launch(types, layout, tile_roles, function, row_symbol, n, k, tile, split, warps, stages))
        if roles["top_k"] is not None:
            tail, tail_scratch = _plan_tail_reduction(types, roles, layout)
            launches += tail
            scratch |= tail_scratch
        variants.append(VariantSpec(name, max_rows, launches))
    spec = _spec(graph, node, row_symbol, variants)
    spec.scratch = {name: (t.dtype.name, t.shape) for name, t in scratch.items()}
    return spec


def _gemm_launch(types: dict, layout: dict, roles: dict, function: str, row_symbol: str, n: int, k: int, tile: dict,
                 split: int, warps: int, stages: int) -> LaunchSpec:
    p = _Params(types, layout)
    for param in ("x", "x2", "rows", "norm", "weight", "bias", "out", "sum"):
        p.tensor(f"{param if param != 'weight' else 'w'}_ptr", roles[param])
    if function == "linear_split_kernel":
        p.tensor("part_ptr", "gemm.split_part")
        p.tensor("count_ptr", "gemm.split_count")
    p.dim("M", row_symbol)
    for param in ("x", "x2", "out", "sum"):
        p.stride(f"stride_{param}", roles[param])
    constexprs = dict(N=n, K=k, EPS=roles["eps"], ADD=roles["x2"] is not None, GATHER=roles["rows"] is not None,
                      NORM=roles["norm"] is not None, BIAS=roles["bias"] is not None, ACT=roles["act"],
                      WRITE_SUM=roles["sum"] is not None, **tile, UPCAST_DOT=False, NORM_OFFSET=roles["norm_offset"])
    block_m, block_n, block_k = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    if function in ("gemv_row_kernel", "gemv_rows_kernel"):  # the RMSNorm prologue in a few wide chunks
        constexprs["RMS_BLOCK"] = min(max(16, next_pow2(k)), 1024 * warps // block_m)
    if function == "gemv_rows_kernel":  # each thread sums its 8-wide loads' products at once
        constexprs["VEC"] = min(8, block_k)
    grid = (GridDim((row_symbol,), block_m), GridDim((n,), block_n))
    if function == "linear_split_kernel":
        constexprs["SPLIT"] = split
        grid += (GridDim((split,)),)
    return _launch("gemm.py", function, p, constexprs, grid, warps, stages)


def _norm_launch(types: dict, layout: dict, roles: dict, row_symbol: str, k: int) -> LaunchSpec:
    """The [add +] RMSNorm of a decode GEMM's rows as a launch of its own, a program a row, into NORMED: repeated
    by every program of the GEMM (K / BLOCK_K dependent loads before its first weight tile), it took 18.9 us of
    the QKV GEMM at 4 rows, which runs in 10.8 us on rows normed beforehand (H200, docs/BENCHMARKS.md)."""
    p = _Params(types, layout)
    for param in ("x", "x2", "rows", "norm", "sum"):
        p.tensor(f"{param}_ptr", roles[param])
    p.tensor("out_ptr", NORMED)
    for param in ("x", "x2", "sum"):
        p.stride(f"stride_{param}", roles[param])
    p.stride("stride_out", NORMED)
    constexprs = dict(K=k, EPS=roles["eps"], ADD=roles["x2"] is not None, GATHER=roles["rows"] is not None,
                      WRITE_SUM=roles["sum"] is not None, NORM_OFFSET=roles["norm_offset"],
                      BLOCK_K=max(16, next_pow2(k)))
    return _launch("gemm.py", "add_rms_norm_kernel", p, constexprs, (GridDim((row_symbol,)),), 4, 1)


def _gemm_tiles(n: int, k: int, act: bool, norm: bool) -> list[tuple]:
    """(variant, max rows, M, N and K tiles, warps, stages, kernel) of a GEMM, by the step's row count; the first
    of each row bound is its default."""
    row_n, row_k, row_warps = one_row_tile(n, k, act)
    row_tiles = (min(row_n, next_pow2(n)), min(row_k, max(16, next_pow2(k))), row_warps, 1, "gemv_row_kernel")
    fma_n = min(4, next_pow2(n))
    while -(-n // fma_n) > MAX_GRID_Y:  # a vocabulary-wide projection: wider column tiles
        fma_n *= 2
    tiles = [("one_row", 1, 1, *row_tiles),
             ("few_rows", 4, 16, *_mma_tile(n, k, 32, 256), 4, 3, "linear_kernel"),
             ("row_programs", 4, 1, *row_tiles),
             ("fma_rows", 4, 4, fma_n, min(1024, max(16, next_pow2(k))), 4, 1, "gemv_rows_kernel"),
             ("split_rows", 4, 16, *_split_tile(n, k), 4, 4, "linear_split_kernel"),
             ("small_rows", SMALL_ROWS, 16, *_mma_tile(n, k, 32, 256), 4, 3, "linear_kernel"),
             ("small_split_rows", SMALL_ROWS, 16, *_split_tile(n, k), 4, 4, "linear_split_kernel"),
             ("mid_rows", 64, 32, *_mma_tile(n, k, 16, 256), 4, 3, "linear_kernel"),
             ("many_rows", None, 64, *_mma_tile(n, k, 64 if act else 128, 64), 8, 3,
              "linear_kernel")]  # no spills at 8 warps
    # The defaults at 4 and 16 rows, from scripts/gpu/kernels.py and tune_gemv.py on the H200 over the 4B benchmark
    # model's shapes (docs/BENCHMARKS.md, session 5): one 16x32 tile a program, on rows normed by a launch of their
    # own where the GEMM has a norm; a plain projection at 4 rows on the CUDA cores (gemv_rows_kernel, 4 rows x 4
    # columns, 8-wide K sums), at 16 rows split-K where K is long (down).
    defaults = {4: "few_rows" if norm else "fma_rows",
                SMALL_ROWS: "small_split_rows" if not norm and k >= 2 * n else "small_rows"}
    return sorted(tiles, key=lambda tile: tile[0] != defaults.get(tile[1]))  # stable: the rest keep their order


def _mma_tile(n: int, k: int, block_n: int, block_k: int) -> tuple[int, int]:
    """N and K tiles for the tensor cores: at least 16 wide, at most the next power of two of the GEMM's."""
    return max(16, min(block_n, next_pow2(n))), max(16, min(block_k, next_pow2(k)))


def _split_tile(n: int, k: int) -> tuple[int, int]:
    return _mma_tile(n, k, 32, 128)


def split_count(n: int, k: int, block_n: int, block_k: int) -> int:
    """K slices of a split decode GEMM: doubled until the column tiles times the slices reach GEMV_PROGRAMS, while
    each slice keeps at least two K tiles."""
    tiles, split = -(-n // block_n), 1
    while tiles * split < GEMV_PROGRAMS and 4 * split * block_k <= k:
        split *= 2
    return split


def _split_scratch(n: int, k: int, roles: dict) -> dict[str, TensorType]:
    """A split GEMM's float32 sums, a plane of [rows, N] (or [rows, 2N] for gate and up) per slice of the split
    tiles planned, and its tickets, one a column tile of the narrowest tiles, zero between launches (the runtime
    zeroes them once, each launch's last programs reset theirs)."""
    width = 2 * n if roles["act"] else n
    block_n, block_k = _split_tile(n, k)
    planes = split_count(n, k, block_n, block_k) * SMALL_ROWS
    return {"gemm.split_part": TensorType(dtype_from_name("f32"), (planes, width)),
            "gemm.split_count": TensorType(dtype_from_name("i32"), (-(-SMALL_ROWS // 16) * -(-n // 16),))}


def one_row_tile(n: int, k: int, act: bool) -> tuple[int, int, int]:
    """(columns, K tile, warps) of the batch-1 GEMV, from a search on the H200 over a 4B model's shapes
    (scripts/gpu/tune_gemv.py, docs/BENCHMARKS.md): few columns want one or two columns per program and long K
    tiles (thousands of programs); more columns, four or eight per program at four warps."""
    if act:
        tile = (4, 512, 4)
    elif n <= 4096:
        tile = (2, 1024, 4) if k >= 8192 else (1, 2048, 8)
    else:
        tile = (8, 256, 4)
    while -(-n // tile[0]) > MAX_GRID_Y:
        tile = (tile[0] * 2, *tile[1:])
    return tile


def gemm_roles(node: Node) -> dict:
    """Reads the kernel's primitive nodes in order: [add] [gather_rows] [rms_norm] linear [split act mul |
    top_k logsumexp sample]. Anything else has no template."""
    inner = [n for n in node.attrs["nodes"]]
    ops = [n.op for n in inner]
    roles: dict = dict(x=None, x2=None, rows=None, norm=None, eps=1e-6, norm_offset=0.0, bias=None, sum=None, act=0,
                       top_k=None, lse=None, sample=None)
    index = 0
    if ops[index] == "add":
        roles["x"], roles["x2"] = inner[index].inputs
        if inner[index].outputs[0] in node.outputs:
            roles["sum"] = inner[index].outputs[0]
        index += 1
    if ops[index] == "gather_rows":
        roles["x"] = roles["x"] or inner[index].inputs[0]
        roles["rows"] = inner[index].inputs[1]
        index += 1
    if ops[index] == "rms_norm":
        roles["x"] = roles["x"] or inner[index].inputs[0]
        roles["norm"], roles["eps"] = inner[index].inputs[1], inner[index].attrs["eps"]
        roles["norm_offset"] = float(inner[index].attrs.get("offset", 0.0))
        index += 1
    linear = inner[index]
    if linear.op != "linear" or (roles["sum"] and roles["rows"]):
        raise PegainferError(f"kernel {node.name}: no GEMM template for {' + '.join(ops)}")
    roles["x"] = roles["x"] or linear.inputs[0]
    roles["weight"] = linear.inputs[1]
    roles["bias"] = linear.inputs[2] if len(linear.inputs) == 3 else None
    roles["out"] = linear.outputs[0]
    rest = ops[index + 1:]
    if rest[:1] == ["split"] and len(rest) == 3 and rest[2] == "mul":
        roles["act"] = {"silu": 1, "gelu_tanh": 2}[rest[1]]
        roles["out"] = inner[-1].outputs[0]
    elif rest == ["top_k", "logsumexp", "sample"]:
        roles["top_k"], roles["lse"], roles["sample"] = inner[-3:]
    elif rest:
        raise PegainferError(f"kernel {node.name}: no GEMM epilogue for {' + '.join(rest)}")
    n_total = linear.output_types[0].shape[-1]
    roles["n"] = n_total // 2 if roles["act"] else n_total
    return roles


def _plan_tail_reduction(types: dict[str, TensorType], roles: dict, layout: dict) -> tuple[list[LaunchSpec], dict]:
    """Two launches: per vocabulary chunk, partial top-k, logsumexp and sampling statistics over many programs;
    then per row, the merge that writes the top-k, the logsumexp and the sampled token (kernels/sampling.py)."""
    logits = roles["out"]
    values, ids = roles["top_k"].outputs
    k = roles["top_k"].attrs["k"]
    sample = roles["sample"]
    sampling = dict(zip(("temperature", "top_k", "top_p", "min_p", "seed", "step"), sample.inputs[1:]))
    rows_symbol, vocab = types[logits].shape
    k_p2 = next_pow2(k)
    chunk = max(k_p2, min(TAIL_CHUNK, next_pow2(vocab)))
    chunks = -(-vocab // chunk)
    scratch = {"tail.keys": TensorType(dtype_from_name("i64"), (rows_symbol, chunks * k_p2)),
               "tail.stats": TensorType(dtype_from_name("f32"), (rows_symbol, chunks * 5)),
               "tail.best": TensorType(dtype_from_name("i32"), (rows_symbol, chunks))}
    types = types | scratch | {o: t for o, t in zip(sample.outputs, sample.output_types)}
    layout = layout | {name: (t.shape[1], 0) for name, t in scratch.items()}
    partial = _Params(types, layout)
    for name, value in (("logits_ptr", logits), *((f"{role}_ptr", v) for role, v in sampling.items()),
                        ("keys_ptr", "tail.keys"), ("stats_ptr", "tail.stats"), ("best_ptr", "tail.best")):
        partial.tensor(name, value)
    partial.stride("stride_logits", logits)
    merge = _Params(types, layout)
    for name, value in (("keys_ptr", "tail.keys"), ("stats_ptr", "tail.stats"), ("best_ptr", "tail.best"),
                        ("logits_ptr", logits), *((f"{role}_ptr", v) for role, v in sampling.items()),
                        ("values_ptr", values), ("ids_ptr", ids), ("lse_ptr", roles["lse"].outputs[0]),
                        ("tokens_ptr", sample.outputs[0]), ("logprobs_ptr", sample.outputs[1])):
        merge.tensor(name, value)
    merge.stride("stride_logits", logits)
    return [_launch("sampling.py", "tail_partial_kernel", partial,
                    dict(VOCAB=vocab, K_P2=k_p2, CHUNK=chunk, CHUNKS=chunks, BLOCK=min(chunk, 1024),
                         GREEDY_BELOW=GREEDY_BELOW), (GridDim((rows_symbol,)), GridDim((chunks,))), num_warps=4),
            _launch("sampling.py", "tail_merge_kernel", merge,
                    dict(VOCAB=vocab, K=k, K_P2=k_p2, CHUNKS=chunks, CHUNKS_P2=next_pow2(chunks),
                         GREEDY_BELOW=GREEDY_BELOW, TOP_P_SLACK=TOP_P_SLACK, FIXED_ONE=FIXED_ONE),
                    (GridDim((rows_symbol,)),), num_warps=8)], scratch


def _plan_rope_kv_write(graph: Graph, node: Node) -> KernelSpec:
    inner = list(node.attrs["nodes"])
    produced = {out: n for n in inner for out in n.outputs}
    write = next(n for n in inner if n.op == "kv_write")
    k_cache, v_cache, k_final, v_heads, slots = write.inputs
    ropes = [n for n in inner if n.op == "rope"]
    k_rope = produced.get(k_final)
    q_ropes = [r for r in ropes if r is not k_rope]
    if k_rope is None or k_rope.op != "rope" or len(q_ropes) != 1 or len(inner) not in (3, 5):
        raise PegainferError(f"kernel {node.name}: the rope/KV-write template needs rope on q and k before the "
                             f"write, found {' + '.join(n.op for n in inner)}")
    q_rope = q_ropes[0]
    if q_rope.attrs != k_rope.attrs:
        raise PegainferError(f"kernel {node.name}: the rope/KV-write template needs one RoPE for q and k, found "
                             f"{q_rope.attrs} and {k_rope.attrs}")
    q_norm, k_norm = produced.get(q_rope.inputs[0]), produced.get(k_rope.inputs[0])
    if q_norm is not None and k_norm is not None and q_norm.attrs != k_norm.attrs:
        raise PegainferError(f"kernel {node.name}: q and k norms differ ({q_norm.attrs}, {k_norm.attrs})")
    norm = q_norm is not None and k_norm is not None
    types = graph.value_types()
    q_heads = q_norm.inputs[0] if norm else q_rope.inputs[0]
    k_heads = k_norm.inputs[0] if norm else k_rope.inputs[0]
    heads, head_dim = types[q_heads].shape[1], types[q_heads].shape[2]
    kv_heads = types[k_cache].shape[2]
    p = _Params(types | {q_rope.outputs[0]: q_rope.output_types[0]}, static_layout(graph))
    for name, value in (("q_ptr", q_heads), ("k_ptr", k_heads), ("v_ptr", v_heads),
                        ("q_norm_ptr", q_norm.inputs[1] if norm else None),
                        ("k_norm_ptr", k_norm.inputs[1] if norm else None), ("pos_ptr", q_rope.inputs[1]),
                        ("slot_ptr", slots), ("q_out_ptr", q_rope.outputs[0]), ("k_cache_ptr", k_cache),
                        ("v_cache_ptr", v_cache)):
        p.tensor(name, value)
    for name, value in (("stride_q", q_heads), ("stride_k", k_heads), ("stride_v", v_heads),
                        ("stride_q_out", q_rope.outputs[0])):
        p.stride(name, value)
    constexprs = dict(HEADS=heads, KV_HEADS=kv_heads, HD=head_dim, EPS=q_norm.attrs["eps"] if norm else 1e-6,
                      NORM=norm, NORM_OFFSET=float(q_norm.attrs.get("offset", 0.0)) if norm else 0.0,
                      THETA=float(q_rope.attrs["theta"]), BLOCK_HALF=next_pow2(head_dim // 2),
                      EARLY=uploaded(graph, q_rope.inputs[1]) and uploaded(graph, slots)
                      and (not norm or {q_norm.inputs[1], k_norm.inputs[1]} <= set(graph.params)),
                      **_rope_scaling_constexprs(q_rope.attrs.get("scaling")))
    row_symbol = types[q_heads].shape[0]
    launch = _launch("attention.py", "qk_rope_kv_write_kernel", p, constexprs,
                     (GridDim((row_symbol,)), GridDim((heads + kv_heads,))), num_warps=1)
    return _spec(graph, node, row_symbol, [VariantSpec("default", None, [launch])])


def _rope_scaling_constexprs(scaling: tuple | None) -> dict:
    """The rope op's scaling attribute as the kernel's SCALING code (0 none, 1 linear, 2 by_wavelength) and its
    numbers."""
    kind = {None: 0, "linear": 1, "by_wavelength": 2}[scaling[0] if scaling else None]
    numbers = [float(v) for v in (scaling or ())[1:]] + [1.0] * 4
    return dict(SCALING=kind, FACTOR=numbers[0], LOW_FREQ=numbers[1], HIGH_FREQ=numbers[2], ORIGINAL=numbers[3])


def _plan_attention(graph: Graph, node: Node, options: PlanOptions) -> KernelSpec:
    (attention,) = node.attrs["nodes"]
    q, k_cache, v_cache, tables, starts, q_lens, ctx_lens = attention.inputs
    types = graph.value_types()
    heads, head_dim = types[q].shape[1], types[q].shape[2]
    kv_heads = types[k_cache].shape[2]
    group = heads // kv_heads
    group_p2 = next_pow2(group)
    block_q = max(1, 16 // group_p2)
    layout = static_layout(graph)
    p = _Params(types | {attention.outputs[0]: attention.output_types[0]}, layout)
    for name, value in (("q_ptr", q), ("k_cache_ptr", k_cache), ("v_cache_ptr", v_cache), ("tables_ptr", tables),
                        ("starts_ptr", starts), ("q_lens_ptr", q_lens), ("ctx_lens_ptr", ctx_lens),
                        ("out_ptr", attention.outputs[0])):
        p.tensor(name, value)
    for name, value in (("stride_q", q), ("stride_out", attention.outputs[0]), ("stride_tables", tables)):
        p.stride(name, value)
    # 64 keys a tile: a decode program's time is its chain of dependent gathers through the block table. EARLY:
    # the lengths and the table are step inputs, read before the wait for the previous kernel; with PREFETCH (the
    # one-sequence split variant) so are the first tile's keys and values of earlier steps: attention's share of
    # the batch-1 step 138 us against 196 (docs/BENCHMARKS.md, session 13)
    constexprs = dict(SCALE=float(attention.attrs["scale"]), KV_HEADS=kv_heads, HD=head_dim, GROUP=group,
                      CACHE_BLOCK=options.block_size, BLOCK_D=max(16, next_pow2(head_dim)), GROUP_P2=group_p2,
                      BLOCK_Q=block_q, BLOCK_KV=max(64, options.block_size), UPCAST_DOT=False,
                      WINDOW=int(attention.attrs.get("window", 0)),
                      EARLY=all(uploaded(graph, v) for v in (tables, starts, q_lens, ctx_lens)), PREFETCH=False)
    batch = types[starts].shape[0]
    grid = (GridDim((batch,)), GridDim((kv_heads,)), GridDim(("max_query_len",), block_q))
    launch = _launch("attention.py", "paged_attention_kernel", p, constexprs, grid, num_warps=4)
    split_launches, scratch = _plan_split_attention(types, layout, attention, constexprs, heads, head_dim)
    variants = [VariantSpec("split_kv", options.split_kv_max_batch, split_launches)] \
        if options.split_kv_max_batch else []
    # One sequence: a decode step's programs (KV heads x SPLIT_KV) fit one wave with PREFETCH's registers; a prompt
    # chunk under PREFILL_QUERIES queries of one sequence runs it too, in more waves (not measured)
    if variants and constexprs["EARLY"]:
        prefetching, _ = _plan_split_attention(types, layout, attention, constexprs | {"PREFETCH": True}, heads,
                                               head_dim)
        variants.insert(0, VariantSpec("split_kv_prefetch", 1, prefetching))
    spec = _spec(graph, node, batch, [_prefill_attention(p, constexprs, batch, kv_heads, group_p2), *variants,
                                      VariantSpec("default", None, [launch])])
    spec.scratch = {name: (t.dtype.name, t.shape) for name, t in scratch.items()}
    return spec


def _prefill_attention(p: _Params, constexprs: dict, batch: str, kv_heads: int, group_p2: int) -> VariantSpec:
    """Steps holding a prompt chunk: tiles of PREFILL_ROWS query rows feed the tensor cores far better than
    decode's 16 (a few queries times the heads sharing a KV head), which keep more programs busy on few rows."""
    block_q = max(1, PREFILL_ROWS // group_p2)
    constexprs = {**constexprs, "BLOCK_Q": block_q}
    grid = (GridDim((batch,)), GridDim((kv_heads,)), GridDim(("max_query_len",), block_q))
    launch = _launch("attention.py", "paged_attention_kernel", p, constexprs, grid, num_warps=4, num_stages=2)
    return VariantSpec("prefill_tiles", None, [launch], min_sizes={"max_query_len": PREFILL_QUERIES})


def _plan_split_attention(types: dict, layout: dict, attention: Node, constexprs: dict, heads: int, head_dim: int):
    """Few sequences (decode at small batch) leave most SMs idle with one program per KV head: split each
    sequence's keys over SPLIT_KV programs and merge their partial softmaxes."""
    q, k_cache, v_cache, tables, starts, q_lens, ctx_lens = attention.inputs
    tokens = types[q].shape[0]
    scratch = {"attention.part_out": TensorType(dtype_from_name("f32"), (tokens, heads * SPLIT_KV * head_dim)),
               "attention.part_lse": TensorType(dtype_from_name("f32"), (tokens, heads * SPLIT_KV))}
    types = types | scratch | {attention.outputs[0]: attention.output_types[0]}
    layout = layout | {name: (t.shape[1], 0) for name, t in scratch.items()}
    split = _Params(types, layout)
    for name, value in (("q_ptr", q), ("k_cache_ptr", k_cache), ("v_cache_ptr", v_cache), ("tables_ptr", tables),
                        ("starts_ptr", starts), ("q_lens_ptr", q_lens), ("ctx_lens_ptr", ctx_lens),
                        ("part_out_ptr", "attention.part_out"), ("part_lse_ptr", "attention.part_lse")):
        split.tensor(name, value)
    split.stride("stride_q", q)
    split.stride("stride_tables", tables)
    split_constexprs = {**constexprs, "HEADS": heads, "SPLITS": SPLIT_KV}
    batch = types[starts].shape[0]
    kv_heads = constexprs["KV_HEADS"]
    grid = (GridDim((batch,)), GridDim((kv_heads,)), GridDim(("max_query_len",), constexprs["BLOCK_Q"], SPLIT_KV))
    merge = _Params(types, layout)
    for name, value in (("part_out_ptr", "attention.part_out"), ("part_lse_ptr", "attention.part_lse"),
                        ("out_ptr", attention.outputs[0])):
        merge.tensor(name, value)
    merge.stride("stride_out", attention.outputs[0])
    merge_constexprs = dict(HEADS=heads, HD=head_dim, BLOCK_D=constexprs["BLOCK_D"], SPLITS=SPLIT_KV)
    return [_launch("attention.py", "paged_attention_split_kernel", split, split_constexprs, grid, num_warps=4),
            _launch("attention.py", "attention_merge_kernel", merge, merge_constexprs,
                    (GridDim((tokens,)), GridDim((heads,))), num_warps=4)], scratch


def _plan_embedding(graph: Graph, node: Node) -> KernelSpec:
    (embedding,) = node.attrs["nodes"]
    types = graph.value_types() | {embedding.outputs[0]: embedding.output_types[0]}
    ids, table = embedding.inputs
    hidden = types[table].shape[1]
    block = min(1024, next_pow2(hidden))
    p = _Params(types, static_layout(graph))
    for name, value in (("ids_ptr", ids), ("table_ptr", table), ("out_ptr", embedding.outputs[0])):
        p.tensor(name, value)
    p.stride("stride_out", embedding.outputs[0])
    row_symbol = types[ids].shape[0]
    launch = _launch("embedding.py", "embedding_kernel", p,
                     dict(HIDDEN=hidden, BLOCK=block, SCALE=float(embedding.attrs.get("scale", 1.0))),
                     (GridDim((row_symbol,)), GridDim((hidden,), block)))
    return _spec(graph, node, row_symbol, [VariantSpec("default", None, [launch])])


def _plan_row_kernel(graph: Graph, node: Node) -> KernelSpec:
    types = graph.value_types() | {o: t for n in node.attrs["nodes"] for o, t in zip(n.outputs, n.output_types)}
    function = f"row_{node.attrs['kind']}"
    source = rowwise.generate_row_kernel(function, node, types, set(graph.params))
    p = _Params(types, static_layout(graph))
    values = [*node.inputs, *node.outputs]
    local = rowwise.local_names(node)
    for value in values:
        p.tensor(f"{local[value]}_ptr", value)
    for value in values:
        if value not in graph.params:
            p.stride(f"stride_{local[value]}", value)
    out_type = node.output_types[0]
    width, inner = out_type.shape[-1], rowwise.inner_rows(out_type)
    row_symbol = out_type.shape[0]
    launch = LaunchSpec(function, f"{function}.py", source, p.params,
                        {**p.constexprs, "D": width, "INNER": inner, "BLOCK_D": next_pow2(width)},
                        (GridDim((row_symbol, inner)), GridDim(), GridDim()), num_warps=1)
    return _spec(graph, node, row_symbol, [VariantSpec("default", None, [launch])])
