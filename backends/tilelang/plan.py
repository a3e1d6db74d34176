"""Planning TileLang candidates for the kernels where Hopper's own instructions pay: the GEMMs of prefill-sized
steps (TMA + wgmma, the SiLU x up epilogue over the merged gate/up weight; an RMSNorm prologue becomes a row
launch first, since TMA feeds the tensor cores the operand as stored), the GEMMs of decode steps of 2 to 16 rows
(weights streamed by TMA, mma.sync), of 1 to 4 rows where the GEMM has a norm (the norm inside the tile), of 1 to
4 rows of a single GEMM (the swapped tile in four mma chains over both K halves of 8 weight rows) and of up to 16 rows
of a single GEMM whose output the next kernel's norm launch adds (a K split into fp32 planes that launch adds), and
causal attention of prefill-shaped steps. A kernel TileLang cannot serve gets no candidate, and the other backends'
variants serve it."""

from dataclasses import replace
from pathlib import Path

from pegainfer.backends.native_gemm import native_gemm
from pegainfer.backends.spec import PLANE_ROWS, GridDim, LaunchSpec, Param, VariantSpec, planes_of
from pegainfer.backends.triton.plan import PREFILL_QUERIES, PlanOptions, gemm_roles, static_layout
from pegainfer.errors import PegainferError
from pegainfer.ir.graph import KERNEL, Graph, Node
from pegainfer.ir.kernel import fused_ops

KERNELS = Path(__file__).parent / "kernels"
SMS = (80, 86, 89, 90)  # TMA and wgmma on 90 (sm_90a); cp.async and mma.sync on the others
_HOPPER = dict(BLOCK_K=64, THREADS=256, SWIZZLE=10)
# (name, SMs, tile): the first that fits a kernel, per SM group, is its default (CI compiles the defaults). On
# sm_90a TileLang adds a producer warpgroup to THREADS consumers; FULL_ROW gives each consumer warpgroup whole tile rows
# (wgmma m64nN with N = BLOCK_N, which reads shared memory less per flop than Square's m64n64); the bigger tiles
# and the fourth stage trade wave quantization at small M for operand reuse, which `pegainfer tune` measures;
# 128x160 (wgmma m64n160) tiles N = 2560 (o_proj, down) 16 wide, so M = 1024 makes 8 x 16 = 128 CTAs, one wave
# on the H200's 132 SMs where 128x128 makes 160 (1.2 waves) and 128x256 makes 80.
# The defaults, sustained at the H200's 700 W cap against cuBLAS at M = 1024 / 4096 / 8192 (docs/BENCHMARKS.md,
# session 7): 128x160 where N allows (o_proj, down: 92-103%); 128x192 where N divides by 192 (QKV, 99 / 93 / 92%:
# 256 CTAs at M = 1024, where 128x256 leaves 1.45 waves and 128x128 rows reads the operands more, 87-88% at 4096+);
# for SiLU x up `wgmma_128x256_merged` (MERGED: gate and up rows loaded into one shared tile, one m64n256 batch into
# one 128x256 accumulator, 128 fp32 registers a consumer thread, 4 stages of 48 KB with the output staged in the
# freed stages; 101 / 97 / 97%, against 99 / 95 / 95% for 128x128 rows with its two accumulators, the A tile read
# twice); else 128x128 on whole rows with 4 stages. No two-accumulator tile bigger than 128x128 fits the registers.
GEMM_TILES = (
    ("wgmma_128x160_rows", (90,), dict(BLOCK_M=128, BLOCK_N=160, STAGES=4, FULL_ROW=True, **_HOPPER)),
    ("wgmma_128x192_rows", (90,), dict(BLOCK_M=128, BLOCK_N=192, STAGES=4, FULL_ROW=True, **_HOPPER)),
    ("wgmma_128x256_merged", (90,), dict(BLOCK_M=128, BLOCK_N=128, STAGES=4, FULL_ROW=True, MERGED=True, **_HOPPER)),
    ("wgmma_128x128_rows", (90,), dict(BLOCK_M=128, BLOCK_N=128, STAGES=4, FULL_ROW=True, **_HOPPER)),
    ("wgmma_128x128", (90,), dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, **_HOPPER)),
    ("wgmma_128x256_rows", (90,), dict(BLOCK_M=128, BLOCK_N=256, STAGES=4, FULL_ROW=True, **_HOPPER)),
    ("wgmma_256x128_rows", (90,), dict(BLOCK_M=256, BLOCK_N=128, STAGES=4, FULL_ROW=True, **_HOPPER)),
    ("mma_128x128", (80, 86, 89), dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, STAGES=3, THREADS=256, SWIZZLE=10)),
)
# Decode steps of up to 16 rows on sm_90a (`_decode_gemm`): (name, BLOCK_N, BLOCK_K, consumer threads, CTAs an SM
# holds). One 16-row tile a CTA; a producer warpgroup streams the weight tile by TMA through as many stages as the
# shared memory of that many CTAs allows, and the activation rows by predicated cp.async (a TMA box reaching past
# the step's rows made the 4-row GEMMs 1.2-1.5x slower); mma.sync on the consumers. decode_16x16 is decode_gemm.py,
# warp-specialised by hand (TileLang's own, with two GEMMs reading one activation stage, released the rows after the
# first: wrong results), launched programmatically; 16x32 and 16x64 are gemm.py's tile, warp-specialised by
# TileLang, for tuning (16x32 was the narrow GEMMs' default until session 11).
DECODE_TILE_M = 16
SM90_SHARED = 228 * 1024  # an SM's shared memory, of which each resident CTA also holds 1 KB for the system
DECODE_TILES = {"decode_16x16": (16, 256, 64, 3), "decode_16x32": (32, 256, 128, 2), "decode_16x64": (64, 128, 128, 2)}
# decode_16x16 of a single GEMM: its shape for N <= 4096 (o_proj, down: 160 tiles) and wider (QKV), each stage's K
# split over CHAINS sums. Launched programmatically at 16 rows (scripts/gpu/kernels.py, docs/BENCHMARKS.md session
# 11): o_proj 7.0 us (70% of the copy bandwidth), down 14.6 (80%), QKV 11.2 with its norm launch, against 8.3, 16.4
# and 12.8 for gemm.py's 16x32 (QKV 10.6 since the norm launch loads G before its wait, session 12). The wider
# tile's rows go out first after the wait, before its last two weight stages (PRE), as measured for QKV (the only
# single GEMM wider than 4096 in the plans measured): the GEMM alone 8.4-8.6 us at 16 rows against 8.9 with
# every stage ahead (scripts/gpu/gemm_probe.py, session 17). SiLU x up keeps 3 stages, 3 CTAs an SM.
CHAINED_TILE = {True: dict(STAGES=6, MIN_BLOCKS=2, CHAINS=4), False: dict(STAGES=4, MIN_BLOCKS=3, CHAINS=2, PRE=2)}
DECODE_SLOTS = (4, 16)
# Steps of up to 4 rows of a GEMM with an RMSNorm prologue (QKV, gate/up) on sm_90a: decode_gemm.py's NORM tile, the
# norm in the tile instead of a launch of its own (whose 2.8 us cost what the tiles gained, session 8), the weight
# tile as mma's A operand, launched programmatically. Its shape by ACT, from scripts/gpu/gemm_probe.py and kernels.py
# on the H200 (docs/BENCHMARKS.md, sessions 9-11): one row, QKV 9.2 us (80% of the copy bandwidth, the norm
# included) against Triton's `one_row` 12.4, gate/up 25.8 (91%) against 27.7, the batch-1 step 2.60 ms against 2.75;
# 4 rows, QKV 9.0 us (82%), gate/up 25.3 (93%), launched programmatically (session 11). Both tiles scale the rows
# in a warpgroup of their own (288 threads a CTA): SiLU x up's 24.9-25.1 us against 25.5-25.6 launched
# programmatically, 26.2-26.4 against 27.0-27.3 plainly (session 11); QKV's, once G was copied whole before the PDL
# wait, with two weight stages ahead of it and two mma chains, 8.5 us at 1 and 4 rows (86%, kernels.py) against
# 9.2 / 9.0 (session 13). o_proj and down get the halved tile below at one row too.
NORMED_TILE = {0: dict(STAGES=5, PRE=2, CHAINS=2), 1: dict(STAGES=3, PRE=1)}
# what both share: a weight tile of 16 rows (each of gate's and up's) over 256 columns, 8 row columns (4 rows and
# their pairs), one consumer warp, 3 CTAs an SM
NORMED_FORM = dict(BLOCK_N=16, BLOCK_K=256, THREADS=32, MIN_BLOCKS=3, SWAP_ROWS=8)
# Steps of one row and of up to 4 of a single GEMM (o_proj, down): decode_gemm.py's HALVES tile, 8 weight rows a CTA
# over both K halves stacked as mma's A operand (W read as [2N, K/2]), 4 rows over both halves as its B, each
# stage's K quarters summed in four chains of mma.sync (one chain's latency held a CTA to about 16 GB/s): 2560
# columns make 320 CTAs of the whole K without a split, where 16 weight rows a tile made 160 for 132 SMs and a K
# split over a cluster of two cost 0.4-0.6 us (scripts/gpu/gemm_probe.py, PDL, docs/BENCHMARKS.md session 14). In the
# plan (kernels.py): o_proj 5.7 us at one row and at four (87 / 86%) against 5.9 for Triton's one-row GEMV and
# 6.2-6.3 for the cluster tile; down 12.7 / 12.9 (92 / 91%) against 13.7 and 12.9-13.1; the batch-1 step 2.47 ms
# against 2.53. SHORT_PRE: a CTA of at most SHORT_STEPS steps (o_proj's 8) issues that many weight stages before its
# PDL wait and the rest after its rows (5.5 / 5.7 us against 5.8 / 5.9 with all six ahead); a longer one (down's 19)
# issues all six ahead (12.6 / 13.0 against 13.1 / 13.2). Offered where N makes at least HALVED_MIN_CTAS CTAs (two
# an SM of the H200, as the 320 measured): a router's 128 columns (16 CTAs) or a 1152-wide o_proj (144) keep
# Triton's one-row GEMV and the 16-row tile.
HALVED_TILE = dict(BLOCK_N=16, BLOCK_K=256, STAGES=6, THREADS=32, MIN_BLOCKS=3, SWAP_ROWS=8, CHAINS=4, HALVES=True)
SHORT_STEPS, SHORT_PRE = 8, 4
HALVED_MIN_CTAS = 264
# Steps of up to 16 rows of a single GEMM whose output the next kernel adds (o_proj, down): decode_gemm.py's PARTIAL
# tile, 32 weight rows a CTA over a quarter of K (SPLIT), so that a 16-row stage is two thirds weights at 320 CTAs for
# 2560 columns, its four fp32 planes added by the next kernel's norm launch (rows.py's PLANES), since summing them in
# the tile (a ticket, a cluster) cost 3 us of o_proj's 6. K steps of 256 where a quarter of K holds whole ones
# (o_proj: 4 steps, 3 stages, 2 of them before the PDL wait), else of 128 in 6 stages (down: 19 steps). At 16 rows
# (docs/BENCHMARKS.md session 16, kernels.py, PDL): o_proj 5.7 us (86% of the copy bandwidth) against 7.1 for the
# 16x16 tile, down 13.3 (88%) against 14.7; the steps at batch 8 and 16 3% and 4% faster (medians of 7 rounds in
# two calls; 1-7% by call), as the 72 norm launches adding the planes spend most of what the GEMMs save (236 us a
# batch-16 step against 148 in session 14's profile). Loading the planes one after another (a loop over them) had
# made those launches slower still and the steps 3-4% slower.
PLANES_TILE = dict(BLOCK_N=32, SPLIT=4, THREADS=64, MIN_BLOCKS=3, CHAINS=4)
PLANES_LONG = dict(BLOCK_K=256, STAGES=3, PRE=2)
PLANES_SHORT = dict(BLOCK_K=128, STAGES=6)
MAX_PLANES = 4  # the planes a norm launch can add (rows.py's PLANES), at least PLANES_TILE's SPLIT
# what CI compiles for every kernel they fit
DEFAULT_VARIANTS = ("wgmma_128x160_rows", "wgmma_128x192_rows", "wgmma_128x256_merged", "wgmma_128x128_rows",
                    "mma_128x128", "flash_ws_128x128", "flash_128x128", "decode_16x16", "decode_norm",
                    "decode_halves", "decode_planes")


def candidates(graph: Graph, node: Node, options: PlanOptions) -> list[VariantSpec]:
    ops = fused_ops(node)
    if ops == ["paged_attention"]:
        return _attention(graph, node, options)
    if "linear" in ops:
        return _gemm(graph, node)
    return []


def _launch(template: str, function: str, params: list[Param], constexprs: dict, grid: tuple[GridDim, ...],
            threads: int, stages: int = 1) -> LaunchSpec:
    grid = tuple(grid) + (GridDim(),) * (3 - len(grid))
    return LaunchSpec(function, template, (KERNELS / template).read_text(), params, constexprs, grid,
                      threads // 32, stages, backend="tilelang")


def _tensor(name: str, value: str, dtype: str = "*bf16") -> Param:
    return Param(name, "tensor", value, dtype, aligned=True)


def _gemm(graph: Graph, node: Node) -> list[VariantSpec]:
    """The row-unbounded slot of a GEMM kernel: [add +] RMSNorm rows, then the TMA GEMM over them."""
    gemm = native_gemm(graph, node)
    if gemm is None or gemm.k % 64 or gemm.n % 128:
        return []  # TMA wants 16-byte aligned rows, and these tiles whole ones
    roles, n, k = gemm.roles, gemm.n, gemm.k
    row_symbol = gemm.types[roles["x"]].shape[0]
    dim = Param("M", "int", f"dim:{row_symbol}", "i32")
    launches, decode_launches, operand, variants = [], [], roles["x"], []
    if roles["norm"]:
        variants += _normed_rows(roles, n, k, dim, row_symbol)
        operand = "gemm.normed"
        params = [_tensor("X", roles["x"]), _tensor("G", roles["norm"]), _tensor("Y", operand), dim]
        if roles["x2"]:
            params.insert(1, _tensor("X2", roles["x2"]))
        if roles["sum"]:
            params.insert(3, _tensor("S", roles["sum"]))
        norm = dict(K=k, EPS=float(roles["eps"]), ADD=roles["x2"] is not None, WRITE_SUM=roles["sum"] is not None,
                    THREADS=128)
        launches.append(_launch("rows.py", "add_rms_norm", params, norm, (GridDim((row_symbol,)),), 128))
        # the decode tiles' (sm_90 only, where programmatic launch exists): their GEMM's weights stream meanwhile;
        # X2 as stored, or as the planes of the split GEMM that made it (PLANES, see _planes_rows)
        decode_params, planes = params, {}
        if roles["x2"]:
            decode_params = params + [_tensor("P", planes_of(roles["x2"]), "*fp32"),
                                      Param("PR", "int", f"rows:{planes_of(roles['x2'])}", "i32")]
            planes = dict(PLANES=MAX_PLANES)
        decode_launches.append(_launch("rows.py", "add_rms_norm", decode_params, norm | dict(PDL=True) | planes,
                                       (GridDim((row_symbol,)),), 128))
    elif roles["x2"]:
        return []  # an add without a norm before a GEMM: not a shape the passes make
    gemm_params = [_tensor("A", operand), _tensor("W", roles["weight"]), _tensor("C", roles["out"]), dim]
    variants += _decode_gemm(decode_launches, gemm_params, n, k, roles["act"], row_symbol,
                             planes_read=_planes_read(graph, roles["out"]))
    for name, sms, tiles in GEMM_TILES:
        if not _tile_fits(tiles, n, roles["act"]):
            continue
        gemm = _launch("gemm.py", "gemm", gemm_params, dict(N=n, K=k, ACT=roles["act"], RESIDUAL=False, **tiles),
                       (GridDim((n,), tiles["BLOCK_N"]), GridDim((row_symbol,), tiles["BLOCK_M"])),
                       tiles["THREADS"], tiles["STAGES"])
        variants.append(VariantSpec(name, None, [*launches, gemm], "tilelang", sms=sms))
    return variants


def _normed_rows(roles: dict, n: int, k: int, dim: Param, row_symbol: str) -> list[VariantSpec]:
    """The 1- and 4-row slots of a GEMM with a norm: decode_gemm.py's NORM tile (see NORMED_TILE), reading the
    rows (and X2's) as stored and writing the residual sum itself; one launch serves both slots (4 rows a CTA)."""
    shape = NORMED_FORM | NORMED_TILE[roles["act"]]
    stage = (shape["BLOCK_N"] * (2 if roles["act"] else 1) + shape["SWAP_ROWS"]) * shape["BLOCK_K"] * 2
    # G whole beside the stages; about 4 KB more: the scalers' reduction, the static barriers, the system's 1 KB
    fits = shape["MIN_BLOCKS"] * (shape["STAGES"] * stage + 2 * k + 4096) <= SM90_SHARED
    if n % shape["BLOCK_N"] or k % shape["BLOCK_K"] or (roles["sum"] and not roles["x2"]) or not fits:
        return []
    names = ["A", *(["X2"] if roles["x2"] else []), "G", *(["S"] if roles["sum"] else []), "W", "C"]
    values = dict(A=roles["x"], X2=roles["x2"], G=roles["norm"], S=roles["sum"], W=roles["weight"], C=roles["out"])
    params = [_tensor(name, values[name]) for name in names] + [dim]
    tiles = dict(N=n, K=k, ACT=roles["act"], PDL=True, NORM=True, ADD=roles["x2"] is not None,
                 WRITE_SUM=roles["sum"] is not None, EPS=float(roles["eps"]), **shape)
    grid = (GridDim((n,), shape["BLOCK_N"]), GridDim((row_symbol,), shape["SWAP_ROWS"] // 2))  # 4 rows a CTA
    threads = shape["THREADS"] + 128 * 2  # the consumer warp, the producer and the scalers
    gemm = _launch("decode_gemm.py", "decode_gemm", params, tiles, grid, threads, shape["STAGES"])
    return [VariantSpec("decode_norm", rows, [gemm], "tilelang", sms=(90,)) for rows in (1, 4)]


def _halved_rows(launches: list[LaunchSpec], params: list[Param], n: int, k: int,
                 row_symbol: str) -> list[VariantSpec]:
    """The 1- and 4-row slots of a single GEMM: decode_gemm.py's HALVES tile (see HALVED_TILE), after the norm
    launch where the GEMM has a norm; one launch serves both slots (4 rows a CTA)."""
    tile = HALVED_TILE
    columns, step_rows = tile["BLOCK_N"] // 2, tile["SWAP_ROWS"] // 2  # a CTA's outputs: 8 columns of 4 rows
    if n % columns or k % (2 * tile["BLOCK_K"]) or n // columns < HALVED_MIN_CTAS:
        return []
    steps = k // 2 // tile["BLOCK_K"]
    tiles = dict(N=n, K=k, ACT=0, PDL=True, **tile) | (dict(PRE=SHORT_PRE) if steps <= SHORT_STEPS else {})
    grid = (GridDim((n,), columns), GridDim((row_symbol,), step_rows))
    gemm = _launch("decode_gemm.py", "decode_gemm", params, tiles, grid, tile["THREADS"] + 128, tile["STAGES"])
    return [VariantSpec("decode_halves", slot, [*launches, gemm], "tilelang", sms=(90,)) for slot in (1, 4)]


def _planes_rows(params: list[Param], n: int, k: int, row_symbol: str) -> list[VariantSpec]:
    """The 16-row slot of a single GEMM whose output the next kernel reads as its add's second operand:
    decode_gemm.py's PARTIAL tile (see PLANES_TILE) writes SPLIT fp32 planes, which that kernel's norm launch adds;
    `sum_planes` follows it, deferred: the runtime runs it only where a kernel reads C itself."""
    a, w, c, dim = params
    shape = PLANES_TILE | (PLANES_LONG if k % (PLANES_LONG["BLOCK_K"] * PLANES_TILE["SPLIT"]) == 0 else PLANES_SHORT)
    if n % shape["BLOCK_N"] or k % (shape["BLOCK_K"] * shape["SPLIT"]) or \
            n // shape["BLOCK_N"] * shape["SPLIT"] < HALVED_MIN_CTAS:
        return []
    planes = _tensor("P", planes_of(c.value), "*fp32")
    grid = (GridDim((n,), shape["BLOCK_N"]), GridDim((row_symbol,), DECODE_TILE_M), GridDim((shape["SPLIT"],)))
    gemm = _launch("decode_gemm.py", "decode_gemm", [a, w, planes, dim],
                   dict(N=n, K=k, ACT=0, PDL=True, PARTIAL=True, **shape), grid, shape["THREADS"] + 128,
                   shape["STAGES"])
    total = _launch("rows.py", "sum_planes", [planes, c, dim], dict(N=n, SPLIT=shape["SPLIT"], THREADS=128, PDL=True),
                    (GridDim((row_symbol,)),), 128)
    return [VariantSpec("decode_planes", 16, [gemm, replace(total, deferred=True)], "tilelang", sms=(90,))]


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
    """The 4- and 16-row slots: decode_gemm.py's 16x16 tile (behind the normed tile at 4 rows where the GEMM has a
    norm, behind the halved one where it has none, which also serves the one-row slot, and at 16 rows behind the
    split tile whose planes the next kernel adds, where it does: `planes_read`), then gemm.py's 16x32 (a single
    GEMM) and 16x64 for tuning."""
    variants = [] if act else _halved_rows(launches, params, n, k, row_symbol)
    if not act and not launches and planes_read:
        variants += _planes_rows(params, n, k, row_symbol)
    for name in ("decode_16x16", "decode_16x32", "decode_16x64"):
        block_n, block_k, threads, min_blocks = DECODE_TILES[name]
        if n % block_n or k % block_k or (act and name == "decode_16x32"):
            continue
        stage = (DECODE_TILE_M + block_n * (2 if act else 1)) * block_k * 2
        stages = min(12, (SM90_SHARED // min_blocks - 2048) // stage)
        grid = (GridDim((n,), block_n), GridDim((row_symbol,), DECODE_TILE_M))
        tiles = dict(N=n, K=k, ACT=act, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, THREADS=threads,
                     MIN_BLOCKS=min_blocks)
        if name == "decode_16x16" and not act:  # see CHAINED_TILE
            tiles |= CHAINED_TILE[n <= 4096]
        if name == "decode_16x16" or act:
            pdl = dict(PDL=True) if name == "decode_16x16" else {}
            gemm = _launch("decode_gemm.py", "decode_gemm", params, tiles | pdl, grid, threads + 128, tiles["STAGES"])
        else:
            gemm = _launch("gemm.py", "gemm", params, dict(tiles, RESIDUAL=False, BLOCK_M=DECODE_TILE_M, SWIZZLE=0,
                                                           ASYNC_ROWS=True), grid, threads, stages)
        variants += [VariantSpec(name, rows, [*launches, gemm], "tilelang", sms=(90,)) for rows in DECODE_SLOTS]
    return variants


def _tile_fits(tiles: dict, n: int, act: int) -> bool:
    """Whole N tiles only. A merged tile exists for the SiLU x up epilogue alone; the unmerged one keeps separate
    gate and up accumulators, which fit the registers up to 128x128."""
    if n % tiles["BLOCK_N"]:
        return False
    if tiles.get("MERGED"):
        return bool(act)
    return not act or tiles["BLOCK_M"] * tiles["BLOCK_N"] <= 128 * 128


def gemm_scratch(graph: Graph, node: Node, variants: list[VariantSpec]) -> dict[str, tuple[str, tuple]]:
    """What the variants' launches write besides the kernel's outputs: the normed rows of a norm launch, read by
    the TMA loads of the GEMM after it ([rows, K] bf16), and a split GEMM's planes ([SPLIT x 16, N] fp32)."""
    launches = [launch for v in variants for launch in v.launches]
    scratch = {}
    if any(launch.function == "add_rms_norm" for launch in launches):
        roles = gemm_roles(node)
        types = graph.value_types()
        scratch["gemm.normed"] = ("bf16", (types[roles["x"]].shape[0], types[roles["weight"]].shape[1]))
    for launch in launches:
        if launch.constexprs.get("PARTIAL"):
            (planes,) = [p.value for p in launch.params if p.name == "P"]
            scratch[planes] = ("f32", (launch.constexprs["SPLIT"] * PLANE_ROWS, launch.constexprs["N"]))
    return scratch


def _attention(graph: Graph, node: Node, options: PlanOptions) -> list[VariantSpec]:
    (attention,) = node.attrs["nodes"]
    q, k_cache, v_cache, tables, starts, q_lens, ctx_lens = attention.inputs
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
              Param("M", "int", f"dim:{tokens}", "i32"), Param("B", "int", f"dim:{batch}", "i32"),
              Param("MAXB", "int", "stride:" + tables, "i32"), Param("NB", "int", "dim:num_blocks", "i32")]
    shape = dict(HEADS=heads, KV_HEADS=kv_heads, HD=head_dim, CACHE_BLOCK=options.block_size,
                 SCALE=float(attention.attrs["scale"]), BLOCK_M=128, BLOCK_N=128, THREADS=256)
    grid = (GridDim((tokens,), 128), GridDim((heads,)), GridDim((batch,)))
    conditional = {"max_query_len": PREFILL_QUERIES}
    flash = _launch("attention.py", "attention", params, dict(shape, STAGES=1), grid, 256)
    variants = [VariantSpec("flash_128x128", None, [flash], "tilelang", conditional, SMS)]
    if 128 % options.block_size == 0:  # the producer's gather copies whole cache pages
        # first, so the sm_90 default (a backend's first variant that the SM runs): 467 TFLOP/s at 8k on the H200
        # against 315 for flash_128x128, and the faster on every shape measured (docs/BENCHMARKS.md)
        ws = _launch("attention.py", "attention_ws", params, shape, grid, 384)
        variants.insert(0, VariantSpec("flash_ws_128x128", None, [ws], "tilelang", conditional, (90,)))
    return variants
