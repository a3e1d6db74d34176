"""Planning TileLang candidates where Hopper's own instructions pay: the GEMMs of prefill-sized steps (TMA + wgmma;
an RMSNorm prologue becomes a row launch first, since TMA feeds the tensor cores the operand as stored), the GEMMs
of decode steps of up to 16 rows (weights streamed by TMA into mma.sync, in one of the four decode forms), and causal
attention of prefill-shaped steps. A kernel TileLang cannot serve gets no candidate, and the other backends'
variants serve it. Variants are named <form>_<M>x<N>, a CTA's tile (step rows x columns; attention's queries x
keys): the form is the decode template's file (decode_tile, decode_normed, decode_halved, decode_planes), gemm.py's
instruction (wgmma, with its warp policy or merge: wgmma_fullrow, wgmma_merged; mma: mma.sync) or flash, flash_ws."""

from dataclasses import dataclass, replace

from pegainfer.backends.native_gemm import native_gemm
from pegainfer.backends.planning import PREFILL_QUERIES, PlanOptions, gemm_roles, static_layout
from pegainfer.backends.spec import GridDim, LaunchSpec, Param, ParamKind, VariantSpec, plane_stride
from pegainfer.backends.tilelang.fp8_plan import fp8_gemm, fp8_scratch, slices_scratch
from pegainfer.backends.tilelang.launches import SM90_SHARED, launch as _launch, tensor as _tensor
from pegainfer.backends.tilelang.swapped_plan import swapped_rows
from pegainfer.backends.triton.attention import decode_rows_launch
from pegainfer.errors import PegainferError
from pegainfer.ir.graph import KERNEL, Graph, Node
from pegainfer.ir.kernel import fused_ops

SMS = (80, 86, 89, 90)  # TMA and wgmma on 90 (sm_90a); cp.async and mma.sync on the others
PRODUCER = 128  # the decode forms' producer warpgroup, after their consumer threads
DECODE_TILE_M = 16  # mma.sync's M: the rows of a 16-row tile's stage
PAIRED_ROWS = 4  # the step's rows of a normed or halved CTA: its stage's 8 hold them and their pairs


@dataclass(frozen=True)
class GemmTile:
    """A prefill tile of gemm.py, by its variant's name (<instruction>[_<warp policy or merge>]_<M>x<N>) and the
    SMs it compiles for. full_row (fullrow): each consumer warpgroup on whole tile rows (wgmma m64nN with N =
    BLOCK_N, fewer shared-memory reads a flop than m64n64); merged: SiLU x up's gate and up rows in one shared tile
    and one accumulator (its N counts both), the A tile read once."""
    name: str
    sms: tuple[int, ...]
    block_m: int
    block_n: int
    stages: int
    block_k: int = 64
    threads: int = 256
    swizzle: int = 10
    full_row: bool = False
    merged: bool = False

    def constexprs(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, STAGES=self.stages,
                    THREADS=self.threads, SWIZZLE=self.swizzle, FULL_ROW=self.full_row, MERGED=self.merged)

    def fits(self, n: int, act: int) -> bool:
        """Whole N tiles only; a merged tile serves SiLU x up alone, and two accumulators fit the registers up to
        128x128."""
        if n % self.block_n:
            return False
        if self.merged:
            return bool(act)
        return not act or self.block_m * self.block_n <= 128 * 128


# The first tile that fits a kernel, per SM group, is its default (CI compiles the defaults); the others are for
# `pegainfer tune`. 128x160 tiles N = 2560 (o_proj, down) so that M = 1024 makes 128 CTAs, one wave on 132 SMs;
# 128x192 suits N that 192 divides (QKV); the merged tile suits SiLU x up. Bigger tiles and a fourth stage trade wave
# quantization at small M for operand reuse.
GEMM_TILES = (
    GemmTile("wgmma_fullrow_128x160", (90,), 128, 160, 4, full_row=True),
    GemmTile("wgmma_fullrow_128x192", (90,), 128, 192, 4, full_row=True),
    GemmTile("wgmma_merged_128x256", (90,), 128, 128, 4, full_row=True, merged=True),
    GemmTile("wgmma_fullrow_128x128", (90,), 128, 128, 4, full_row=True),
    GemmTile("wgmma_128x128", (90,), 128, 128, 3),
    GemmTile("wgmma_fullrow_128x256", (90,), 128, 256, 4, full_row=True),
    GemmTile("wgmma_fullrow_256x128", (90,), 256, 128, 4, full_row=True),
    GemmTile("mma_128x128", (80, 86, 89), 128, 128, 3, block_k=32),
)


@dataclass(frozen=True)
class DecodeTile:
    """A decode tile: weight rows and K columns a stage, stages (0: as many as the CTAs an SM holds leave room for),
    consumer threads, the CTAs an SM must hold (registers capped to fit them), a single GEMM's mma chains (one chain
    waits on each mma's result) and the weight stages issued before the PDL wait (0: all the ring holds)."""
    block_n: int
    block_k: int
    stages: int
    threads: int
    min_blocks: int
    chains: int = 1
    pre: int = 0

    def filled(self, act: int) -> "DecodeTile":
        """The tile with its stages, where it names none: as many 16-row stages as fit, at most 12."""
        if self.stages:
            return self
        stage = (DECODE_TILE_M + self.block_n * (2 if act else 1)) * self.block_k * 2
        return replace(self, stages=min(12, (SM90_SHARED // self.min_blocks - 2048) // stage))

    def shape(self) -> dict:
        return dict(BLOCK_N=self.block_n, BLOCK_K=self.block_k, STAGES=self.stages, THREADS=self.threads,
                    MIN_BLOCKS=self.min_blocks)

    def constexprs(self) -> dict:
        return self.shape() | dict(CHAINS=self.chains, PRE=self.pre)


DECODE_SLOTS = (4, 16)
# decode_tile_16x16 of a single GEMM: the narrow ones (N <= NARROW_N: o_proj, down) stream a deeper ring at 2 CTAs
# an SM; a wider one (QKV) sends each step's rows ahead of its last weight stages
NARROW_N = 4096
NARROW_CHAINED = DecodeTile(16, 256, 6, 64, 2, chains=4)
WIDE_CHAINED = DecodeTile(16, 256, 4, 64, 3, chains=2, pre=2)
SILU_16X16 = DecodeTile(16, 256, 0, 64, 3)  # decode_tile_16x16 of SiLU x up: two GEMMs a stage, no chains
# gemm.py's 16-row mma.sync tiles, warp-specialised by TileLang (single GEMMs), and SiLU x up's 16x64 through
# decode_tile.py: (a single GEMM's variant, SiLU x up's or None, the tile, the slots it serves). The 16x64 one also
# serves steps of 17 to MID_ROWS rows, block after block of 16 rows sharing each weight tile through the L2: the
# default there until a tile made for those rows exists.
MID_ROWS = 64
TUNING_TILES = (("mma_16x32", None, DecodeTile(32, 256, 0, 128, 2), DECODE_SLOTS),
                ("mma_16x64", "decode_tile_16x64", DecodeTile(64, 128, 0, 128, 2), (*DECODE_SLOTS, MID_ROWS)))
# The norm inside the tile for steps of up to 4 rows (decode_normed.py): a single GEMM (QKV) in two chains with two
# weight stages ahead of the wait; SiLU x up's two GEMMs a stage, with one
NORMED_SINGLE = DecodeTile(16, 256, 5, 32, 3, chains=2, pre=2)
NORMED_SILU = DecodeTile(16, 256, 3, 32, 3, pre=1)
# A single GEMM's steps of up to 4 rows (decode_halved.py), 8 weight rows a CTA over both K halves: offered where N
# makes HALVED_MIN_CTAS CTAs (two an SM); a CTA of at most SHORT_STEPS steps issues SHORT_PRE weight stages before its
# wait and the rest after its rows, a longer one all it holds
HALVED = DecodeTile(16, 256, 6, 32, 3, chains=4)
SHORT_STEPS, SHORT_PRE = 8, 4
HALVED_MIN_CTAS = 264
# A single GEMM's steps of up to 16 rows whose output the next kernel's norm launch adds (decode_planes.py): K split
# in PLANES_SPLIT fp32 planes that launch adds (rows.py's PLANES), 32 weight rows a CTA; K steps of 256 where a
# quarter of K holds whole ones (o_proj), else of 128 in a deeper ring (down)
PLANES_SPLIT = 4
PLANES_TILES = (DecodeTile(32, 256, 3, 64, 3, chains=4, pre=2), DecodeTile(32, 128, 6, 64, 3, chains=4))
MAX_PLANES = 4  # the planes a norm launch can add (rows.py's PLANES), at least PLANES_SPLIT
# what CI compiles for every kernel they fit
DEFAULT_VARIANTS = ("wgmma_fullrow_128x160", "wgmma_fullrow_128x192", "wgmma_merged_128x256",
                    "wgmma_fullrow_128x128", "mma_128x128", "flash_ws_128x128", "flash_128x128",
                    "mixed_16_ws_128x128", "mixed_16_128x128", "decode_tile_16x16", "decode_normed_4x16",
                    "decode_halved_4x8", "decode_planes_16x32")


def candidates(graph: Graph, node: Node, options: PlanOptions) -> list[VariantSpec]:
    ops = fused_ops(node)
    if ops == ["paged_attention"]:
        return _attention(graph, node, options)
    if "linear" in ops:
        return _gemm(graph, node)
    return []


def _gemm(graph: Graph, node: Node) -> list[VariantSpec]:
    """Every slot of a GEMM kernel: the decode forms, then the row-unbounded slot's [add +] RMSNorm row launch and
    the TMA GEMM over its rows."""
    gemm = native_gemm(graph, node, fp8=True)
    if gemm is None or gemm.k % 64 or gemm.n % 128:
        return []  # TMA wants 16-byte aligned rows, and these tiles whole ones
    roles, n, k = gemm.roles, gemm.n, gemm.k
    row_symbol = gemm.types[roles["x"]].shape[0]
    if roles["scale"] is not None:
        return fp8_gemm(gemm, row_symbol)
    dim = Param("M", ParamKind.DIM, row_symbol, "i32")
    launches, decode_launches, operand, variants = [], [], roles["x"], []
    if roles["norm"]:
        variants += _normed_rows(roles, n, k, dim, row_symbol)
        operand = "gemm.normed"
        launches, decode_launches = _norm_launches(roles, k, dim, row_symbol, operand)
    elif roles["x2"]:
        return []  # an add without a norm before a GEMM: not a shape the passes make
    gemm_params = [_tensor("A", operand), _tensor("W", roles["weight"]), _tensor("C", roles["out"]), dim]
    prefill = []
    for tile in GEMM_TILES:
        if not tile.fits(n, roles["act"]):
            continue
        constexprs = dict(N=n, K=k, ACT=roles["act"], RESIDUAL=False) | tile.constexprs()
        gemm = _launch("gemm.py", "gemm", gemm_params, constexprs,
                       (GridDim((n,), tile.block_n), GridDim((row_symbol,), tile.block_m)), tile.threads, tile.stages)
        prefill.append(VariantSpec(tile.name, None, [*launches, gemm], "tilelang", sms=tile.sms))
    variants += swapped_rows(decode_launches, gemm_params, n, k, roles["act"], row_symbol,
                             next((v for v in prefill if 90 in v.sms), None))
    variants += _decode_gemm(decode_launches, gemm_params, n, k, roles["act"], row_symbol,
                             planes_read=_planes_read(graph, roles["out"]))
    return variants + prefill


def _norm_launches(roles: dict, k: int, dim: Param, row_symbol: str,
                   operand: str) -> tuple[list[LaunchSpec], list[LaunchSpec]]:
    """The [add +] RMSNorm row launch that writes a GEMM's operand: as the prefill tiles take it, and as the decode
    tiles do (programmatic, so that their GEMM's weights stream meanwhile; X2 as stored, or as the planes of the
    split GEMM that made it: PLANES, see _planes_rows)."""
    params = [_tensor("X", roles["x"]), _tensor("G", roles["norm"]), _tensor("Y", operand), dim]
    if roles["x2"]:
        params.insert(1, _tensor("X2", roles["x2"]))
    if roles["sum"]:
        params.insert(3, _tensor("S", roles["sum"]))
    norm = dict(K=k, EPS=float(roles["eps"]), ADD=roles["x2"] is not None, WRITE_SUM=roles["sum"] is not None,
                THREADS=128, NORM_OFFSET=roles["norm_offset"])
    grid = (GridDim((row_symbol,)),)
    decode_params, planes = params, {}
    if roles["x2"]:
        decode_params = params + [Param("P", ParamKind.PLANES, roles["x2"], "*fp32", aligned=True),
                                  Param("PR", ParamKind.PLANE_ROWS, roles["x2"], "i32")]
        planes = dict(PLANES=MAX_PLANES)
    return ([_launch("rows.py", "add_rms_norm", params, norm, grid, 128)],
            [_launch("rows.py", "add_rms_norm", decode_params, norm | dict(PDL=True) | planes, grid, 128)])


def _normed_rows(roles: dict, n: int, k: int, dim: Param, row_symbol: str) -> list[VariantSpec]:
    """The 1- and 4-row slots of a GEMM with a norm: decode_normed.py, reading the rows (and X2's) as stored and
    writing the residual sum itself; one launch serves both slots."""
    tile = NORMED_SILU if roles["act"] else NORMED_SINGLE
    stage = (tile.block_n * (2 if roles["act"] else 1) + 2 * PAIRED_ROWS) * tile.block_k * 2
    # G whole beside the stages; about 4 KB more: the scalers' reduction, the static barriers, the system's 1 KB
    fits = tile.min_blocks * (tile.stages * stage + 2 * k + 4096) <= SM90_SHARED
    if n % tile.block_n or k % tile.block_k or (roles["sum"] and not roles["x2"]) or not fits:
        return []
    names = ["A", *(["X2"] if roles["x2"] else []), "G", *(["S"] if roles["sum"] else []), "W", "C"]
    values = dict(A=roles["x"], X2=roles["x2"], G=roles["norm"], S=roles["sum"], W=roles["weight"], C=roles["out"])
    params = [_tensor(name, values[name]) for name in names] + [dim]
    constexprs = dict(N=n, K=k, ACT=roles["act"], PDL=True, ADD=roles["x2"] is not None,
                      WRITE_SUM=roles["sum"] is not None, EPS=float(roles["eps"]),
                      NORM_OFFSET=roles["norm_offset"]) | tile.constexprs()
    grid = (GridDim((n,), tile.block_n), GridDim((row_symbol,), PAIRED_ROWS))
    threads = tile.threads + 2 * PRODUCER  # the consumer warp, the producer and the scalers
    gemm = _launch("decode_normed.py", "decode_normed", params, constexprs, grid, threads, tile.stages)
    return [VariantSpec("decode_normed_4x16", rows, [gemm], "tilelang", sms=(90,)) for rows in (1, 4)]


def _halved_rows(launches: list[LaunchSpec], params: list[Param], n: int, k: int,
                 row_symbol: str) -> list[VariantSpec]:
    """The 1- and 4-row slots of a single GEMM: decode_halved.py, after the norm launch where the GEMM has a
    norm; one launch serves both slots."""
    columns = HALVED.block_n // 2  # a CTA's outputs: 8 columns of 4 rows
    if n % columns or k % (2 * HALVED.block_k) or n // columns < HALVED_MIN_CTAS:
        return []
    tile = replace(HALVED, pre=SHORT_PRE) if k // 2 // HALVED.block_k <= SHORT_STEPS else HALVED
    grid = (GridDim((n,), columns), GridDim((row_symbol,), PAIRED_ROWS))
    gemm = _launch("decode_halved.py", "decode_halved", params, dict(N=n, K=k, PDL=True) | tile.constexprs(), grid,
                   tile.threads + PRODUCER, tile.stages)
    return [VariantSpec("decode_halved_4x8", slot, [*launches, gemm], "tilelang", sms=(90,)) for slot in (1, 4)]


def _planes_rows(params: list[Param], n: int, k: int, row_symbol: str) -> list[VariantSpec]:
    """The 16-row slot of a single GEMM whose output the next kernel reads as its add's second operand:
    decode_planes.py writes PLANES_SPLIT fp32 planes, which that kernel's norm launch adds; `sum_planes` follows it,
    deferred: the runtime runs it only where a kernel reads C itself."""
    a, w, c, dim = params
    tile = next((t for t in PLANES_TILES if k % (t.block_k * PLANES_SPLIT) == 0), None)
    if tile is None or n % tile.block_n or n // tile.block_n * PLANES_SPLIT < HALVED_MIN_CTAS:
        return []
    planes = Param("P", ParamKind.PLANES, c.value, "*fp32", aligned=True)
    grid = (GridDim((n,), tile.block_n), GridDim((row_symbol,), DECODE_TILE_M), GridDim((PLANES_SPLIT,)))
    constexprs = dict(N=n, K=k, PDL=True, SPLIT=PLANES_SPLIT, PARTIAL=True) | tile.constexprs()
    gemm = _launch("decode_planes.py", "decode_planes", [a, w, planes, dim], constexprs, grid, tile.threads + PRODUCER,
                   tile.stages)
    total = _launch("rows.py", "sum_planes", [planes, c, dim], dict(N=n, SPLIT=PLANES_SPLIT, THREADS=128, PDL=True),
                    (GridDim((row_symbol,)),), 128)
    return [VariantSpec("decode_planes_16x32", 16, [gemm, replace(total, deferred=True)], "tilelang", sms=(90,))]


def _planes_read(graph: Graph, value: str) -> bool:
    """Whether every kernel of `graph` reading `value` (or, for a body's carried output, the input it becomes in
    the next repetition) adds it as its norm launch's second operand, which can read a split GEMM's planes: where
    one does not, the runtime would sum the planes first, a launch more than the 16-row tile costs."""
    names, types = [value], graph.value_types()
    if value in graph.outputs and graph.outputs.index(value) < len(graph.inputs):  # carried: an input as it is
        carried = list(graph.inputs)[graph.outputs.index(value)]
        if graph.inputs[carried] == types[value]:
            names.append(carried)
    readers = [node for node in graph.nodes if set(names) & set(node.inputs)]
    return bool(readers) and all(node.op == KERNEL and "linear" in fused_ops(node) and _adds_second(node, names)
                                 for node in readers)


def _adds_second(node: Node, names: list[str]) -> bool:
    try:
        roles = gemm_roles(node)
    except PegainferError:
        return False
    return roles["norm"] is not None and roles["x2"] in names and roles["x"] not in names


def _decode_gemm(launches: list[LaunchSpec], params: list[Param], n: int, k: int, act: int, row_symbol: str,
                 planes_read: bool = False) -> list[VariantSpec]:
    """The 1-, 4- and 16-row slots of the GEMM kernel (`launches`: the norm launch before them, if any): the halved
    tile at 1 and 4 rows and the planes tile at 16 (where the next kernel adds the planes: `planes_read`) for a
    single GEMM, then the 16-row tiles at 4 and 16 rows (decode_tile_16x16, and for tuning a single GEMM's mma_16x32
    and mma_16x64, SiLU x up's decode_tile_16x64, which also serve 17 to MID_ROWS rows)."""
    variants = [] if act else _halved_rows(launches, params, n, k, row_symbol)
    if not act and not launches and planes_read:
        variants += _planes_rows(params, n, k, row_symbol)
    chained = SILU_16X16 if act else NARROW_CHAINED if n <= NARROW_N else WIDE_CHAINED
    tiles = [("decode_tile_16x16", chained, True, DECODE_SLOTS)] + [(silu if act else single, tile, False, slots)
                                                                    for single, silu, tile, slots in TUNING_TILES]
    for name, tile, default, slots in tiles:
        tile = tile.filled(act)
        if name is None or n % tile.block_n or k % tile.block_k:
            continue
        grid = (GridDim((n,), tile.block_n), GridDim((row_symbol,), DECODE_TILE_M))
        if default or act:  # decode_tile.py: its consumers free a stage after both GEMMs
            constexprs = dict(N=n, K=k, ACT=act, PDL=default) | tile.constexprs()
            gemm = _launch("decode_tile.py", "decode_tile", params, constexprs, grid, tile.threads + PRODUCER,
                           tile.stages)
        else:
            constexprs = dict(N=n, K=k, ACT=act, RESIDUAL=False, BLOCK_M=DECODE_TILE_M, SWIZZLE=0, ASYNC_ROWS=True)
            gemm = _launch("gemm.py", "gemm", params, constexprs | tile.shape(), grid, tile.threads, tile.stages)
        variants += [VariantSpec(name, rows, [*launches, gemm], "tilelang", sms=(90,)) for rows in slots]
    return variants


def gemm_scratch(graph: Graph, node: Node, variants: list[VariantSpec]) -> dict[str, tuple[str, tuple]]:
    """What the variants' launches write besides the kernel's outputs: the normed rows of a norm launch, read by
    the TMA loads of the GEMM after it ([rows, K] bf16), the e4m3 rows and their scales of a quantizing launch
    (fp8_plan.py), and a split GEMM's planes ([SPLIT x PLANE_STRIDE, N] fp32: 16-row planes at 16 rows, MAX_ROWS-row
    ones of the swapped tiles; sized for the largest)."""
    launches = [launch for v in variants for launch in v.launches]
    functions = {launch.function for launch in launches}
    scratch = {}
    if functions & {"add_rms_norm", "quantize_rows"}:
        roles = gemm_roles(node)
        types = graph.value_types()
        rows, k = types[roles["x"]].shape[0], types[roles["weight"]].shape[1]
        if "add_rms_norm" in functions:
            scratch["gemm.normed"] = ("bf16", (rows, k))
        if "quantize_rows" in functions:
            scratch |= fp8_scratch(rows, k)
    scratch |= slices_scratch(launches)
    for launch in launches:
        if launch.constexprs.get("PARTIAL"):
            (planes,) = [p.buffer for p in launch.params if p.kind is ParamKind.PLANES]
            rows = launch.constexprs["SPLIT"] * plane_stride(launch.constexprs)
            if planes in scratch:  # the 16-row tile's and the swapped tiles' planes share the scratch
                rows = max(rows, scratch[planes][1][0])
            scratch[planes] = ("f32", (rows, launch.constexprs["N"]))
    return scratch


def _attention(graph: Graph, node: Node, options: PlanOptions) -> list[VariantSpec]:
    (attention,) = node.attrs["nodes"]
    q, k_cache, v_cache, tables, starts, q_lens, ctx_lens = attention.inputs[:7]
    out = attention.outputs[0]
    types = graph.value_types() | {out: attention.output_types[0]}
    layout = static_layout(graph)
    tokens, heads, head_dim = types[q].shape
    kv_heads = types[k_cache].shape[2]
    batch = types[starts].shape[0]
    if head_dim not in (64, 128) or types[q].dtype.name != "bf16" or types[k_cache].dtype.name != "bf16" \
            or any(layout[v] != (heads * head_dim, 0) for v in (q, out)) or types[tables].dtype.name != "i32" \
            or attention.attrs.get("window", 0):
        return []  # the kernels mask causally only: a sliding window stays with Triton's
    params = [_tensor("Q", q), _tensor("KC", k_cache), _tensor("VC", v_cache), _tensor("TABLES", tables, "*i32"),
              _tensor("STARTS", starts, "*i32"), _tensor("Q_LENS", q_lens, "*i32"),
              _tensor("CTX_LENS", ctx_lens, "*i32"), _tensor("O", out),
              Param("M", ParamKind.DIM, tokens, "i32"), Param("B", ParamKind.DIM, batch, "i32"),
              Param("MAXB", ParamKind.STRIDE, tables, "i32"), Param("NB", ParamKind.DIM, "num_blocks", "i32")]
    shape = dict(HEADS=heads, KV_HEADS=kv_heads, HD=head_dim, CACHE_BLOCK=options.block_size,
                 SCALE=float(attention.attrs["scale"]), BLOCK_M=128, BLOCK_N=128, THREADS=256)
    grid = (GridDim((tokens,), 128), GridDim((heads,)), GridDim((batch,)))
    conditional = {"max_query_len": PREFILL_QUERIES}
    mixed = conditional | {"decode_seqs": 1}
    decode = decode_rows_launch(graph, node, options)
    flash = _launch("attention.py", "attention", params, dict(shape, STAGES=1), grid, 256)
    after = _launch("attention.py", "attention", _after_decode(params), dict(shape, STAGES=1), _chunks(grid), 256)
    variants = [VariantSpec("mixed_16_128x128", None, [decode, after], "tilelang", mixed, SMS),
                VariantSpec("flash_128x128", None, [flash], "tilelang", conditional, SMS)]
    if 128 % options.block_size == 0:  # the producer's gather copies whole cache pages
        # first, so the sm_90 default (a backend's first variant that the SM runs): its softmax runs under the
        # tensor cores
        ws = _launch("attention.py", "attention_ws", params, shape, grid, 384)
        ws_after = _launch("attention.py", "attention_ws", _after_decode(params), shape, _chunks(grid), 384)
        variants[:0] = [VariantSpec("mixed_16_ws_128x128", None, [decode, ws_after], "tilelang", mixed, (90,)),
                        VariantSpec("flash_ws_128x128", None, [ws], "tilelang", conditional, (90,))]
    return variants


# A mixed step (decode tokens first, then prompt chunks: the scheduler's order) runs its decode rows on Triton's
# 16-row tiles (the heads of a KV head together) and only its chunks on the 128-query tiles, which would give
# each decode row a tile per head and read its keys once per head.
def _after_decode(params: list[Param]) -> list[Param]:
    """The 128-query tiles' parameters over the sequences after the step's decode rows: the per-sequence tensors
    from row `decode_seqs` on, and their count."""
    per_sequence = {"TABLES", "STARTS", "Q_LENS", "CTX_LENS"}
    return [replace(p, skip="decode_seqs", aligned=False) if p.name in per_sequence
            else replace(p, value="prefill_seqs") if p.name == "B" else p for p in params]


def _chunks(grid: tuple[GridDim, GridDim, GridDim]) -> tuple[GridDim, GridDim, GridDim]:
    return grid[0], grid[1], GridDim(("prefill_seqs",))
