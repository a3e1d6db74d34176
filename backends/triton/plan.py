"""Planning: each kernel node of the kernel DAG -> the Triton launches that run it (a template specialised by
constexprs, or a generated row kernel), their parameter ABI, grid rule and row-count variants."""

from dataclasses import astuple, dataclass, replace

from pegainfer.backends.planning import PlanOptions, gemm_roles, static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, LaunchSpec, VariantSpec
from pegainfer.backends.triton import rowwise
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.kernel import fused_ops
from pegainfer.ir.ops.sampling import FIXED_ONE, GREEDY_BELOW, TOP_P_SLACK
from pegainfer.ir.types import TensorType

SMALL_ROWS = 16  # up to this many rows a GEMM uses its decode-shaped tiles
TAIL_CHUNK = 4096  # vocabulary entries per program of the sampler tail's chunk launches, at most
TAIL_LEAD = 8  # the sampler tail's merge ranks this many candidates a chunk when none has more
PENALTY_SCAN = 128  # penalty entries the sampler tail compares at once when it seeks a block's
GEMV_PROGRAMS = 528  # a few-rows GEMV aims for at least this many programs: 4 per SM of an H100/H200
DECODE_TILE_ROWS = 16  # the tensor-core tiles of decode steps (up to SMALL_ROWS rows): their norm runs apart
# the rows a decode GEMM's norm launch writes for its tiles, in float32: the tiles round them to the weights' type
# as the fused prologue does (and Triton's interpreter, whose bf16 stores truncate, is not asked to)
NORMED = "gemm.normed_rows"
# the LM head's normed rows for its 64-row tiles ([rows, K] float32): with the norm in each of its thousands of
# programs, every one would first read all its rows twice over
NORMED_ALL = "gemm.normed_all"
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the GEMMs' column tiles)
SAMPLER_OPS = ["mask_tokens", "penalize_tokens", "top_k", "logsumexp", "sample"]  # a tail after gathered logits


@dataclass(frozen=True)
class GemmTile:
    """A GEMM variant: the rows it serves at most (None: any), the M, N and K tile of a program, and the kernel."""
    name: str
    max_rows: int | None
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    function: str

    @property
    def split(self) -> bool:
        return self.function == "linear_split_kernel"


def plan_kernel(graph: Graph, node: Node, options: PlanOptions) -> KernelSpec:
    ops = fused_ops(node)
    if "paged_attention" in ops:
        from pegainfer.backends.triton.attention import plan_attention
        return plan_attention(graph, node, options)
    if "kv_write" in ops:
        from pegainfer.backends.triton.rope import plan_rope_kv_write
        return plan_rope_kv_write(graph, node)
    if ops in (["causal_conv1d"], ["gated_delta_rule"]):
        from pegainfer.backends.triton import recurrence
        if ops == ["causal_conv1d"]:
            return recurrence.plan_causal_conv1d(graph, node)
        return recurrence.plan_gated_delta_rule(graph, node)
    if ops in (["moe_route"], ["moe_experts"]):
        from pegainfer.backends.triton import moe
        return moe.plan_moe_route(graph, node) if ops == ["moe_route"] else moe.plan_moe_experts(graph, node)
    if ops in (["latent_write"], ["latent_attention"], ["head_linear"], ["rope"]):
        from pegainfer.backends.triton import latent
        if ops == ["latent_attention"]:
            return latent.plan_latent_attention(graph, node, options)
        if ops == ["latent_write"]:
            return latent.plan_latent_write(graph, node)
        return latent.plan_head_linear(graph, node) if ops == ["head_linear"] else latent.plan_rope(graph, node)
    if ops in (["lora"], ["lora_add"]):
        from pegainfer.backends.triton.lora import plan_lora
        return plan_lora(graph, node)
    if "linear" in ops:
        return _plan_gemm(graph, node)
    if ops == SAMPLER_OPS:
        return _plan_sampler(graph, node)
    if ops in (["embedding"], ["concat"]):
        from pegainfer.backends.triton.gather import plan_concat, plan_embedding
        return plan_embedding(graph, node) if ops == ["embedding"] else plan_concat(graph, node)
    if rowwise.supports(node.attrs["nodes"]):
        return _plan_row_kernel(graph, node)
    raise PegainferError(f"kernel {node.name} ({node.attrs['kind']}: {' + '.join(ops)}) has no Triton template")


def _plan_gemm(graph: Graph, node: Node) -> KernelSpec:
    roles = gemm_roles(node)
    types = graph.value_types() | {o: t for n in node.attrs["nodes"] for o, t in zip(n.outputs, n.output_types)}
    row_symbol = types[roles["rows"]].shape[0] if roles["rows"] else types[roles["x"]].shape[0]
    n, k = roles["n"], types[roles["weight"]].shape[1]
    layout = static_layout(graph)
    variants, scratch = [], {}
    own_scratch = _split_scratch(n, k, roles) | {NORMED: TensorType(dtype_from_name("f32"), (SMALL_ROWS, k)),
                                                 NORMED_ALL: TensorType(dtype_from_name("f32"), (row_symbol, k))}
    types, layout = types | own_scratch, layout | {name: (t.shape[-1], 0) for name, t in own_scratch.items()}
    for tile in _gemm_tiles(n, k, bool(roles["act"]), roles["norm"] is not None, roles["top_k"] is not None):
        tile = _within_scale_blocks(tile, roles["scale_block"], n, k)
        split = split_count(n, k, tile.block_n, tile.block_k) if tile.split else 1
        if tile.split and (roles["top_k"] is not None or split == 1):
            continue  # not before the sampler's tail (its own scratch), nor where one slice is enough
        assert not tile.split or tile.max_rows <= tile.block_m, tile  # one row tile a plane
        launches, tile_roles = [], roles
        if roles["norm"] and tile.block_m == DECODE_TILE_ROWS and roles["top_k"] is None:
            assert tile.max_rows is not None and tile.max_rows <= SMALL_ROWS, tile  # NORMED holds SMALL_ROWS rows
            launches.append(_norm_launch(types, layout, roles, row_symbol, k))
            tile_roles = roles | dict(x=NORMED, x2=None, rows=None, norm=None, sum=None)
            scratch[NORMED] = own_scratch[NORMED]
        elif roles["norm"] and roles["top_k"] is not None and tile.block_m == 64:
            launches.append(_norm_launch(types, layout, roles, row_symbol, k, NORMED_ALL))
            tile_roles = roles | dict(x=NORMED_ALL, x2=None, rows=None, norm=None, sum=None)
            scratch[NORMED_ALL] = own_scratch[NORMED_ALL]
        if tile.split:
            scratch |= {name: own_scratch[name] for name in ("gemm.split_part", "gemm.split_count")}
        launches.append(_gemm_launch(types, layout, tile_roles, tile, row_symbol, n, k, split))
        if roles["top_k"] is not None:
            tail, tail_scratch = _plan_tail_reduction(types, roles, layout)
            launches += tail
            scratch |= tail_scratch
        variants.append(VariantSpec(tile.name, tile.max_rows, launches))
    spec = kernel_spec(graph, node, row_symbol, variants)
    spec.scratch = {name: (t.dtype.name, t.shape) for name, t in scratch.items()}
    return spec


def _gemm_launch(types: dict, layout: dict, roles: dict, tile: GemmTile, row_symbol: str, n: int, k: int,
                 split: int) -> LaunchSpec:
    function, warps, block_m, block_n, block_k = tile.function, tile.warps, tile.block_m, tile.block_n, tile.block_k
    p = Params(types, layout)
    for param in ("x", "x2", "rows", "norm", "weight", "scale", "bias", "out", "sum"):
        p.tensor(f"{param if param != 'weight' else 'w'}_ptr", roles[param])
    if tile.split:
        p.tensor("part_ptr", "gemm.split_part")
        p.tensor("count_ptr", "gemm.split_count")
    p.dim("M", row_symbol)
    for param in ("x", "x2", "out", "sum"):
        p.stride(f"stride_{param}", roles[param])
    constexprs = dict(N=n, K=k, EPS=roles["eps"], ADD=roles["x2"] is not None, GATHER=roles["rows"] is not None,
                      NORM=roles["norm"] is not None, BIAS=roles["bias"] is not None, ACT=roles["act"],
                      WRITE_SUM=roles["sum"] is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                      UPCAST_DOT=False, NORM_OFFSET=roles["norm_offset"], **scale_constexprs(roles, k))
    if function in ("gemv_row_kernel", "gemv_rows_kernel"):  # the RMSNorm prologue in a few wide chunks
        constexprs["RMS_BLOCK"] = min(max(16, next_pow2(k)), 1024 * warps // block_m)
    if function == "gemv_rows_kernel":  # each thread sums its 8-wide loads' products at once
        constexprs["VEC"] = min(8, block_k)
    grid = (GridDim((row_symbol,), block_m), GridDim((n,), block_n))
    if tile.split:
        constexprs["SPLIT"] = split
        grid += (GridDim((split,)),)
    return launch("gemm.py", function, p, constexprs, grid, warps, tile.stages)


def scale_constexprs(roles: dict, k: int) -> dict:
    """An FP8 weight's scale mode (kernels/gemm.py): 0 none, 1 a scale per output column, 2 one per block."""
    block = roles["scale_block"]
    if block is None:
        return dict(SCALE=0, SCALE_N=1, SCALE_K=1)
    return dict(SCALE=2 if _per_block(block, k) else 1, SCALE_N=block[0], SCALE_K=block[1])


def _per_block(block: tuple[int, int] | None, k: int) -> bool:
    """Scales that change along a row's K (blocks), not one per output column."""
    return block is not None and not (block[0] == 1 and block[1] >= k)


def _within_scale_blocks(tile: GemmTile, block: tuple[int, int] | None, n: int, k: int) -> GemmTile:
    """A tile whose K tiles each fall in one scale block (K tiles are powers of two: at most the block's width,
    which must be one too), its columns widened by as much so a program streams as many weights."""
    if not _per_block(block, k) or tile.block_k <= block[1]:
        return tile
    if block[1] & (block[1] - 1):
        raise PegainferError(f"FP8 weights: scale blocks {block[1]} columns wide; the GEMM tiles need a power of two")
    wider = min(tile.block_n * (tile.block_k // block[1]), max(tile.block_n, next_pow2(n)))
    return replace(tile, block_n=wider, block_k=block[1])


def _norm_launch(types: dict, layout: dict, roles: dict, row_symbol: str, k: int, out: str = NORMED) -> LaunchSpec:
    """The [add +] RMSNorm of a decode GEMM's rows as a launch of its own, a program a row, into `out`: repeated
    by every program of the GEMM, it would put K / BLOCK_K dependent loads before each one's first weight tile."""
    p = Params(types, layout)
    for param in ("x", "x2", "rows", "norm", "sum"):
        p.tensor(f"{param}_ptr", roles[param])
    p.tensor("out_ptr", out)
    for param in ("x", "x2", "sum"):
        p.stride(f"stride_{param}", roles[param])
    p.stride("stride_out", out)
    constexprs = dict(K=k, EPS=roles["eps"], ADD=roles["x2"] is not None, GATHER=roles["rows"] is not None,
                      WRITE_SUM=roles["sum"] is not None, NORM_OFFSET=roles["norm_offset"],
                      BLOCK_K=max(16, next_pow2(k)))
    return launch("norm_rows.py", "add_rms_norm_kernel", p, constexprs, (GridDim((row_symbol,)),), 4, 1)


def _gemm_tiles(n: int, k: int, act: bool, norm: bool, head: bool = False) -> list[GemmTile]:
    """A GEMM's tiles by the step's row count; the first of each row bound is its default. A tile is named
    <form>_<rows of its program>: gemv (CUDA cores: gemv_row_kernel at 1 row, gemv_rows_kernel at more), dot
    (tl.dot tensor-core tiles), split_k (tl.dot over K slices); its N and K tiles follow the GEMM's shape. One tile
    may serve two row bounds under one name (gemv_1 at 1 and 4 rows, dot_16 and split_k_16 at 4 and 16). The LM
    head (`head`) runs its 64-row tiles from 17 rows on, after a norm launch: its 32-row tiles read the weights
    twice a 64-row step."""
    row_n, row_k, row_warps = gemv_1_tile(n, k, act)
    row = (min(row_n, next_pow2(n)), min(row_k, max(16, next_pow2(k))), row_warps, 1, "gemv_row_kernel")
    fma_n = min(4, next_pow2(n))
    while -(-n // fma_n) > MAX_GRID_Y:  # a vocabulary-wide projection: wider column tiles
        fma_n *= 2
    tiles = [GemmTile("gemv_1", 1, 1, *row),
             GemmTile("dot_16", 4, 16, *_mma_tile(n, k, 32, 256), 4, 3, "linear_kernel"),
             GemmTile("gemv_1", 4, 1, *row),
             GemmTile("gemv_4", 4, 4, fma_n, min(1024, max(16, next_pow2(k))), 4, 1, "gemv_rows_kernel"),
             GemmTile("split_k_16", 4, 16, *_split_tile(n, k), 4, 4, "linear_split_kernel"),
             GemmTile("dot_16", SMALL_ROWS, 16, *_mma_tile(n, k, 32, 256), 4, 3, "linear_kernel"),
             GemmTile("split_k_16", SMALL_ROWS, 16, *_split_tile(n, k), 4, 4, "linear_split_kernel"),
             GemmTile("dot_32", 64, 32, *_mma_tile(n, k, 16, 256), 4, 3, "linear_kernel"),
             GemmTile("dot_64", None, 64, *_mma_tile(n, k, 64 if act else 128, 64), 8, 3,
                      "linear_kernel")]  # no spills at 8 warps
    if head:
        tiles.insert(-1, GemmTile("dot_64", 64, *astuple(tiles[-1])[2:]))
    # The defaults at 4 and 16 rows (docs/BENCHMARKS.md): one 16x32 tile a program, on rows normed by a launch of
    # their own where the GEMM has a norm; a plain projection at 4 rows on the CUDA cores (gemv_rows_kernel, 4 rows
    # x 4 columns, 8-wide K sums), at 16 rows split-K where K is long (down).
    defaults = {4: "dot_16" if norm else "gemv_4", 64: "dot_64" if head else "dot_32",
                SMALL_ROWS: "split_k_16" if not norm and k >= 2 * n else "dot_16"}
    return sorted(tiles, key=lambda tile: tile.name != defaults.get(tile.max_rows))  # stable: the rest keep order


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
    tile = next(t for t in _gemm_tiles(n, k, bool(roles["act"]), False) if t.split)
    tile = _within_scale_blocks(tile, roles["scale_block"], n, k)
    planes = split_count(n, k, tile.block_n, tile.block_k) * SMALL_ROWS
    return {"gemm.split_part": TensorType(dtype_from_name("f32"), (planes, width)),
            "gemm.split_count": TensorType(dtype_from_name("i32"), (-(-SMALL_ROWS // 16) * -(-n // 16),))}


def gemv_1_tile(n: int, k: int, act: bool) -> tuple[int, int, int]:
    """(columns, K tile, warps) of the batch-1 GEMV, as a search over a 4B model's shapes found them: few columns
    want one or two columns per program and long K tiles (thousands of programs); more, four or eight at 4 warps."""
    if act:
        tile = (4, 512, 4)
    elif n <= 4096:
        tile = (2, 1024, 4) if k >= 8192 else (1, 2048, 8)
    else:
        tile = (8, 256, 4)
    while -(-n // tile[0]) > MAX_GRID_Y:
        tile = (tile[0] * 2, *tile[1:])
    return tile


def _plan_tail_reduction(types: dict[str, TensorType], roles: dict, layout: dict) -> tuple[list[LaunchSpec], dict]:
    """Three launches: per vocabulary chunk, the logsumexp statistics and the chunk's largest key; per chunk
    again, its share of the top-k candidates (of the rows that want them) and sampling statistics; then per row,
    the merge that writes the top-k, the logsumexp and the sampled token (kernels/sampling.py). Each row's grammar
    mask and penalties are applied as its logits are read. Chunks are small enough that a row has at least k of
    them where the vocabulary allows."""
    logits = roles["out"]
    values, ids = roles["top_k"].outputs
    k = roles["top_k"].attrs["k"]
    sample = roles["sample"]
    sampling = dict(zip(("temperature", "top_k", "top_p", "min_p", "seed", "step"), sample.inputs[1:]))
    rows_symbol, vocab = types[logits].shape
    k_p2 = next_pow2(k)
    chunk = max(k_p2, min(TAIL_CHUNK, next_pow2(vocab), 1 << max(0, (vocab // k).bit_length() - 1)))
    chunks = -(-vocab // chunk)
    scratch = {"tail.bound": TensorType(dtype_from_name("i64"), (rows_symbol, chunks)),
               "tail.keys": TensorType(dtype_from_name("i64"), (rows_symbol, chunks * k_p2)),
               "tail.count": TensorType(dtype_from_name("i32"), (rows_symbol, chunks)),
               "tail.stats": TensorType(dtype_from_name("f32"), (rows_symbol, chunks * 5)),
               "tail.best": TensorType(dtype_from_name("i32"), (rows_symbol, chunks))}
    types = types | scratch | {o: t for o, t in zip(sample.outputs, sample.output_types)}
    layout = layout | {name: (t.shape[1], 0) for name, t in scratch.items()}
    _, bitmask, mask_index = roles["mask"].inputs
    penalties = tuple(zip(("penalty_start_ptr", "penalty_count_ptr", "penalty_ids_ptr", "penalty_terms_ptr"),
                          roles["penalize"].inputs[1:]))
    bound = Params(types, layout)
    for name, value in (("logits_ptr", logits), ("bitmask_ptr", bitmask), ("mask_index_ptr", mask_index),
                        *penalties, ("stats_ptr", "tail.stats"), ("bound_ptr", "tail.bound")):
        bound.tensor(name, value)
    bound.stride("stride_logits", logits)
    bound.stride("stride_bitmask", bitmask)
    wanted = ("wanted_ptr", roles["top_k"].inputs[1])
    partial = Params(types, layout)
    for name, value in (("logits_ptr", logits), *((f"{role}_ptr", v) for role, v in sampling.items()), wanted,
                        ("bitmask_ptr", bitmask), ("mask_index_ptr", mask_index), *penalties,
                        ("bound_ptr", "tail.bound"), ("keys_ptr", "tail.keys"), ("count_ptr", "tail.count"),
                        ("stats_ptr", "tail.stats"), ("best_ptr", "tail.best")):
        partial.tensor(name, value)
    partial.stride("stride_logits", logits)
    partial.stride("stride_bitmask", bitmask)
    merge = Params(types, layout)
    for name, value in (("keys_ptr", "tail.keys"), ("count_ptr", "tail.count"), ("stats_ptr", "tail.stats"),
                        ("best_ptr", "tail.best"), ("bound_ptr", "tail.bound"), ("logits_ptr", logits),
                        *((f"{role}_ptr", v) for role, v in sampling.items()), wanted,
                        ("values_ptr", values), ("ids_ptr", ids), ("lse_ptr", roles["lse"].outputs[0]),
                        ("tokens_ptr", sample.outputs[0]), ("logprobs_ptr", sample.outputs[1])):
        merge.tensor(name, value)
    merge.stride("stride_logits", logits)
    grid = (GridDim((rows_symbol,)), GridDim((chunks,)))
    block = min(chunk, 1024)
    return [launch("sampling.py", "tail_bound_kernel", bound,
                   dict(VOCAB=vocab, CHUNK=chunk, CHUNKS=chunks, BLOCK=block, SCAN=PENALTY_SCAN), grid, num_warps=4),
            launch("sampling.py", "tail_partial_kernel", partial,
                   dict(VOCAB=vocab, K=k, K_P2=k_p2, CHUNK=chunk, CHUNKS=chunks, CHUNKS_P2=next_pow2(chunks),
                        BLOCK=block, SCAN=PENALTY_SCAN, GREEDY_BELOW=GREEDY_BELOW), grid, num_warps=4),
            launch("sampling.py", "tail_merge_kernel", merge,
                   dict(VOCAB=vocab, K=k, K_P2=k_p2, CHUNKS=chunks, CHUNKS_P2=next_pow2(chunks),
                        LEAD=min(TAIL_LEAD, k_p2), GREEDY_BELOW=GREEDY_BELOW, TOP_P_SLACK=TOP_P_SLACK,
                        FIXED_ONE=FIXED_ONE),
                   (GridDim((rows_symbol,)),), num_warps=8)], scratch


def _plan_sampler(graph: Graph, node: Node) -> KernelSpec:
    """The sampler tail over logits another node wrote (a sharded graph's, gathered from the ranks): the LM head
    tail's three launches without its GEMM."""
    inner = list(node.attrs["nodes"])
    types = graph.value_types() | {o: t for n in inner for o, t in zip(n.outputs, n.output_types)}
    roles = dict(zip(("mask", "penalize", "top_k", "lse", "sample"), inner), out=inner[0].inputs[0])
    launches, scratch = _plan_tail_reduction(types, roles, static_layout(graph))
    spec = kernel_spec(graph, node, types[roles["out"]].shape[0], [VariantSpec("default", None, launches)])
    spec.scratch = {name: (t.dtype.name, t.shape) for name, t in scratch.items()}
    return spec


def _plan_row_kernel(graph: Graph, node: Node) -> KernelSpec:
    types = graph.value_types() | {o: t for n in node.attrs["nodes"] for o, t in zip(n.outputs, n.output_types)}
    function = f"row_{node.attrs['kind']}"
    source = rowwise.generate_row_kernel(function, node, types, set(graph.params))
    p = Params(types, static_layout(graph))
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
    whole = rowwise.reduces(node.attrs["nodes"])  # else a row's columns over several programs
    block = next_pow2(width) if whole else min(rowwise.SPLIT_BLOCK, next_pow2(width))
    row = LaunchSpec(function, f"{function}.py", source, p.params,
                     {**p.constexprs, "D": width, "INNER": inner, "BLOCK_D": block},
                     (GridDim((row_symbol, inner)), GridDim((width,), block), GridDim()),
                     num_warps=1 if whole else 4)
    return kernel_spec(graph, node, row_symbol, [VariantSpec("default", None, [row])])
