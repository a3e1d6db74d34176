"""Planning the swapped tiles (kernels/swapped.py) for decode steps of 17 to 256 rows. Each GEMM class (a wide
single GEMM: QKV; a narrow one: o_proj, down; SiLU x up) gets, per row slot, the tiles that measured best on the
H200 (docs/benchmarks/2026-12-01-swapped-rows.md), the first its default: a swapped tile of one of three families,
or the GEMM's prefill tile where the step's rows fill its 128-row M well enough."""

from dataclasses import dataclass, replace

from pegainfer.backends.spec import GridDim, LaunchSpec, Param, ParamKind, VariantSpec
from pegainfer.backends.tilelang.launches import SM90_SHARED, launch

COLUMNS = 64  # wgmma's M: the output columns of a consumer warpgroup
MAX_ROWS = 256  # the largest slot; its steps run in row blocks of the 128-row tile; a split tile's plane holds as many
MAX_SPLIT = 4
MAX_STAGES = 8
SLACK = 12 * 1024  # of an SM's shared memory a CTA leaves to barriers, the system's 1 KB and the epilogue
NARROW_N = 4096  # a single GEMM of at most this many columns is narrow: its K is split to fill the SMs
PREFILL = "prefill"  # a slot entry: the GEMM's prefill tile


@dataclass(frozen=True)
class Family:
    """How a swapped tile fills the GPU: the CTAs an SM holds (their stages share its shared memory), the CTA count
    below which K is split (the H200 has 132 SMs), and a CTA's output columns (a consumer warpgroup per 64,
    sharing the rows' stage)."""
    form: str
    ctas: int
    busy: int
    columns: int


PAIR = Family("wgmma_swapped", 2, 132, COLUMNS)  # two CTAs an SM
DEEP = Family("wgmma_swapped_deep", 1, 90, COLUMNS)  # one CTA an SM, the deepest ring
WIDE = Family("wgmma_swapped", 1, 132, 2 * COLUMNS)  # 128 columns: the rows' stage read once for two warpgroups
ROW_TILES = {32: (32, 128), 64: (64, 128), 128: (128, 64), MAX_ROWS: (128, 64)}  # slot: a CTA's rows, K step
ACT_BLOCK_K = 64  # SiLU x up's K step: two weight tiles a stage
# per GEMM class and slot, the candidates in order (the first the default)
SLOT_PLAN: dict[str, dict[int, tuple]] = {
    "wide": {32: (DEEP,), 64: (DEEP,), 128: (DEEP,), MAX_ROWS: (PREFILL, DEEP)},
    "narrow": {32: (PAIR,), 64: (PAIR, WIDE), 128: (WIDE, PAIR), MAX_ROWS: (PAIR, WIDE, PREFILL)},
    "silu": {32: (WIDE, PAIR), 64: (PAIR, PREFILL), 128: (PREFILL, WIDE), MAX_ROWS: (PREFILL, WIDE)},
}


def gemm_class(n: int, act: int) -> str:
    return "silu" if act else "wide" if n > NARROW_N else "narrow"


def stages(family: Family, block_m: int, block_k: int, act: int) -> int:
    stage = ((2 if act else 1) * family.columns + block_m) * block_k * 2
    return min(MAX_STAGES, (SM90_SHARED // family.ctas - SLACK) // stage)


def split_for(n: int, k: int, family: Family, slot: int, block_m: int, block_k: int) -> int:
    """K slices: doubled while the CTAs of the slot's largest step stay under the family's busy count and each
    slice keeps whole K steps."""
    ctas, split = n // family.columns * -(-slot // block_m), 1
    while ctas * split < family.busy and split < MAX_SPLIT and k % (2 * split * block_k) == 0:
        split *= 2
    return split


def swapped_rows(launches: list[LaunchSpec], params: list[Param], n: int, k: int, act: int, row_symbol: str,
                 prefill: VariantSpec | None) -> list[VariantSpec]:
    """The 32-, 64-, 128- and 256-row slots of a GEMM kernel on sm_90a (`launches`: its norm launch, if any, in
    its decode form, which adds a split GEMM's planes of MAX_ROWS rows, before the prefill tile in these slots too;
    `prefill`: its prefill tile's variant, where it has one: its norm launch, then its GEMM)."""
    launches = [replace(l, constexprs=l.constexprs | dict(PLANE_STRIDE=MAX_ROWS)) if l.constexprs.get("PLANES")
                else l for l in launches]
    variants = []
    for slot, entries in SLOT_PLAN[gemm_class(n, act)].items():
        block_m, block_k = ROW_TILES[slot]
        block_k = ACT_BLOCK_K if act else block_k
        for entry in entries:
            if entry == PREFILL:
                if prefill is not None:
                    variants.append(VariantSpec(prefill.name, slot, [*launches, prefill.launches[-1]], "tilelang",
                                                sms=prefill.sms))
            elif k % block_k == 0 and n % entry.columns == 0:
                split = 1 if act else split_for(n, k, entry, slot, block_m, block_k)
                tail = _swapped_launches(params, n, k, act, row_symbol, entry, block_m, block_k, split)
                variants.append(VariantSpec(f"{entry.form}_{block_m}x{entry.columns}", slot, [*launches, *tail],
                                            "tilelang", sms=(90,)))
    return variants


def _swapped_launches(params: list[Param], n: int, k: int, act: int, row_symbol: str, family: Family, block_m: int,
                      block_k: int, split: int) -> list[LaunchSpec]:
    """The tile's launch, and where K is split the sum of its slices, deferred: the runtime runs it only where a
    kernel after it reads C itself, not the planes (runtime/gpu/planes.py)."""
    a, w, c, dim = params
    threads = 2 * family.columns  # the consumer warpgroups
    depth = stages(family, block_m, block_k, act)
    constexprs = dict(N=n, K=k, ACT=act, BLOCK_N=family.columns, BLOCK_M=block_m, BLOCK_K=block_k, STAGES=depth,
                      THREADS=threads, SPLIT=split, MIN_BLOCKS=family.ctas)
    grid = (GridDim((row_symbol,), block_m), GridDim((n,), family.columns), GridDim((split,)))
    if split == 1:
        return [launch("swapped.py", "swapped", [a, w, c, dim], constexprs, grid[:2], threads, depth)]
    planes = Param("P", ParamKind.PLANES, c.value, "*fp32", aligned=True)
    total = launch("swapped.py", "sum_slices", [planes, c, dim],
                   dict(N=n, SPLIT=split, THREADS=128, PLANE_STRIDE=MAX_ROWS), (GridDim((row_symbol,)),), 128)
    return [launch("swapped.py", "swapped", [a, w, planes, dim],
                   constexprs | dict(PARTIAL=True, PLANE_STRIDE=MAX_ROWS), grid, threads, depth),
            replace(total, deferred=True)]
