"""Planning TileLang's FP8 GEMMs (sm_90a, W8A8): a row launch quantizes the rows to e4m3 in groups of 128 columns
(rows.py `quantize_rows`, which also does the GEMM's [add +] RMSNorm), then wgmma e4m3 x e4m3: gemm_fp8.py's tiles
(rows as M) for prefill-sized steps, swapped_fp8.py's (weights as M) for decode steps of up to 256 rows. Weights in
128 x 128 blocks (quant_method fp8 checkpoints) or with a scale per output column (compressed-tensors',
`--quantization fp8`); other blocks stay with Triton's W8A16 tiles."""

from dataclasses import dataclass

from pegainfer.backends.native_gemm import NativeGemm
from pegainfer.backends.spec import GridDim, LaunchSpec, Param, ParamKind, VariantSpec
from pegainfer.backends.tilelang.launches import SM90_SHARED, launch, tensor
from pegainfer.backends.tilelang.swapped_plan import MAX_ROWS

GROUP = 128  # rows.py's and gemm_fp8.py's quantization group: a K step, and a weight block's width
QUANTIZED = "gemm.quantized"  # the rows in e4m3, [rows, K]
ROW_SCALES = "gemm.row_scales"  # their groups' scales, [rows, K / 128]
SLICES = "gemm.slices"  # a split W8A8 tile's fp32 planes, [SPLIT x MAX_ROWS, N]
FP8 = "*fp8e4nv"


@dataclass(frozen=True)
class Fp8Tile:
    """A CTA's rows and output columns (merged: the columns of gate, and as many of up, in one accumulator), its
    stages and consumer threads."""
    name: str
    block_m: int
    block_n: int
    merged: bool
    stages: int = 4
    threads: int = 256


FP8_TILES = (Fp8Tile("w8a8_128x128", 128, 128, merged=False),
             Fp8Tile("w8a8_merged_128x128", 128, 64, merged=True))


def scale_mode(block: tuple[int, int], k: int) -> int | None:
    """gemm_fp8.py's SCALE for the weights' scale blocks: 2 per 128 x 128 block, 1 per output column, None when
    the kernel has no form for them."""
    if tuple(block) == (GROUP, GROUP):
        return 2
    return 1 if block[0] == 1 and block[1] >= k else None


# Decode slots of the swapped tiles: the rows of a CTA's stage (wgmma's N; SiLU x up at most 64, its four
# accumulators in registers); one launch serves 1, 4 and 16 rows
SWAPPED_ROWS = {1: 16, 4: 16, 16: 16, 32: 32, 64: 64, 128: 128, 256: 128}
COLUMNS = 64  # wgmma's M: a consumer warpgroup's output columns
BUSY_CTAS = 132  # the H200's SMs: K is split (up to MAX_SPLIT) while a step's CTAs leave some idle
MAX_SPLIT = 4
SLACK = 12 * 1024  # of an SM's shared memory a CTA leaves to barriers, the system's 1 KB and the epilogue
PREFILL_SLACK = 8 * 1024  # the prefill tile's barriers and the system's 1 KB


def fp8_gemm(gemm: NativeGemm, row_symbol: str) -> list[VariantSpec]:
    """Every slot of a GEMM of FP8 weights: the quantizing row launch, then the swapped tile (decode rows) or the
    prefill tile (any rows)."""
    roles, n, k = gemm.roles, gemm.n, gemm.k
    mode = scale_mode(roles["scale_block"], k)
    tile = next((t for t in FP8_TILES if t.merged == bool(roles["act"])), None)
    if mode is None or k % GROUP or tile is None or n % tile.block_n or roles["act"] not in (0, 1):
        return []
    dim = Param("M", ParamKind.DIM, row_symbol, "i32")
    quantize, decode = (_quantize_launch(roles, k, dim, row_symbol, pdl) for pdl in (False, True))
    gemm_params = [tensor("A", QUANTIZED, FP8), tensor("AS", ROW_SCALES, "*fp32"), tensor("W", roles["weight"], FP8),
                   tensor("WS", roles["scale"], "*fp32"), tensor("C", roles["out"]), dim]
    # the CTA's row scales sit beside the stages (the output tile reuses their bytes): fewer stages for a long K
    stage = (tile.block_m + (2 if tile.merged else 1) * tile.block_n) * GROUP
    stages = min(tile.stages, (SM90_SHARED - tile.block_m * (k // GROUP) * 4 - PREFILL_SLACK) // stage)
    constexprs = dict(N=n, K=k, ACT=roles["act"], SCALE=mode, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                      STAGES=stages, THREADS=tile.threads, SWIZZLE=10)
    grid = (GridDim((n,), tile.block_n), GridDim((row_symbol,), tile.block_m))
    product = launch("gemm_fp8.py", "gemm_fp8", gemm_params, constexprs, grid, tile.threads, stages)
    return _swapped(decode, gemm_params, n, k, roles["act"], mode, row_symbol) \
        + [VariantSpec(tile.name, None, [quantize, product], "tilelang", sms=(90,))]


def _swapped(quantize: LaunchSpec, params: list[Param], n: int, k: int, act: int, mode: int,
             row_symbol: str) -> list[VariantSpec]:
    """The decode slots: swapped_fp8.py after the quantizing launch, K split where the CTAs are few."""
    if n % COLUMNS:
        return []
    variants = []
    for slot, block_m in SWAPPED_ROWS.items():
        block_m = min(block_m, 64) if act else block_m
        fragments = (4 if act else 2) * COLUMNS * block_m // 128  # registers a thread, for the sums
        ctas_per_sm = 2 if fragments <= 64 else 1
        split, ctas = 1, n // COLUMNS * -(-slot // block_m)
        while not act and ctas * split < BUSY_CTAS and split < MAX_SPLIT and (k // GROUP) % (2 * split) == 0:
            split *= 2
        stage = ((2 if act else 1) * COLUMNS + block_m) * GROUP
        fixed = block_m * (k // GROUP) * 4 + COLUMNS * block_m * 4 + SLACK  # the row scales, the epilogue
        stages = min(8, (SM90_SHARED // ctas_per_sm - fixed) // stage)
        constexprs = dict(N=n, K=k, ACT=act, SCALE=mode, BLOCK_N=COLUMNS, BLOCK_M=block_m, STAGES=stages,
                          THREADS=2 * COLUMNS, SPLIT=split, MIN_BLOCKS=ctas_per_sm, PDL=True)
        grid = (GridDim((row_symbol,), block_m), GridDim((n,), COLUMNS), GridDim((split,)))
        c, dim = params[-2:]
        if split == 1:
            tail = [launch("swapped_fp8.py", "swapped_fp8", params, constexprs, grid[:2], 2 * COLUMNS, stages)]
        else:
            planes = tensor("P", SLICES, "*fp32")
            tail = [launch("swapped_fp8.py", "swapped_fp8", [*params[:-2], planes, dim], constexprs, grid,
                           2 * COLUMNS, stages),
                    launch("swapped.py", "sum_slices", [planes, c, dim], dict(N=n, SPLIT=split, THREADS=128),
                           (GridDim((row_symbol,)),), 128)]
        variants.append(VariantSpec(f"w8a8_swapped_{block_m}x{COLUMNS}", slot, [quantize, *tail], "tilelang",
                                    sms=(90,)))
    return variants


def _quantize_launch(roles: dict, k: int, dim: Param, row_symbol: str, pdl: bool) -> LaunchSpec:
    """rows.py's quantize_rows over the GEMM's rows (programmatic before the decode tiles: `pdl`)."""
    params = [tensor("X", roles["x"])]
    if roles["x2"]:
        params.append(tensor("X2", roles["x2"]))
    if roles["norm"]:
        params.append(tensor("G", roles["norm"]))
    if roles["sum"]:
        params.append(tensor("S", roles["sum"]))
    params += [tensor("Y", QUANTIZED, FP8), tensor("AS", ROW_SCALES, "*fp32"), dim]
    return launch("rows.py", "quantize_rows", params,
                  dict(K=k, EPS=float(roles["eps"]), NORM=roles["norm"] is not None, ADD=roles["x2"] is not None,
                       WRITE_SUM=roles["sum"] is not None, THREADS=128, PDL=pdl, NORM_OFFSET=roles["norm_offset"]),
                  (GridDim((row_symbol,)),), 128)


def slices_scratch(launches: list[LaunchSpec]) -> dict[str, tuple[str, tuple]]:
    """The split W8A8 tiles' planes (of the step's rows, summed by their own launch), sized for the most slices any
    of them cuts and MAX_ROWS rows."""
    sums = [launch.constexprs for launch in launches if launch.function == "sum_slices" and not launch.deferred]
    return {SLICES: ("f32", (max(s["SPLIT"] for s in sums) * MAX_ROWS, sums[0]["N"]))} if sums else {}


def fp8_scratch(rows: str | int, k: int) -> dict[str, tuple[str, tuple]]:
    return {QUANTIZED: ("f8e4m3", (rows, k)), ROW_SCALES: ("f32", (rows, k // GROUP))}
