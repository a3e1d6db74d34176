"""TileLang GEMM tiles at shapes of our choosing, against cuBLAS: the experiments behind the plan's prefill tiles
(kernels.py times only what the plan compiled, at the model's own shapes; this times a template at any N, K and
tile, e.g. the plain GEMM of gate/up's whole 2N rows beside the SiLU x up tile that serves it).

Here, with no GPU: `python scripts/gpu/gemm_probe.py prepare --out .gpu/probe [--only LABEL...]` compiles each case
of CASES to an sm_90a cubin with its launch record (index.json).
On the H200: `python3 scripts/gpu/gemm_probe.py run --dir .gpu/probe --out $OUT` checks each case against torch
and times it at every M of PREFILL_M (a CUDA graph of repeats, best of ROUNDS alternated with cuBLAS's plain GEMM
of the same [M, rows of W, K] through torch), printing TFLOP/s and the share of cuBLAS; every number goes to
$OUT/probe.json. Decode cases (`prepare --decode`: decode_gemm.py's tiles with programmatic dependent launch, split,
swapped, with the norm inside or in several mma chains, and gemm.py's 16-row tile, at the 4B model's decode GEMMs)
are timed at 1, 4 and 16 rows as a chain of launches over weight copies past the L2, plainly and programmatically,
in TB/s and as a share of the copy bandwidth measured in the same run ($OUT/decode_probe.json); a paired case ("...
after norm") is timed with rows.py's norm launch before it, which writes its rows, as the plan runs QKV after down.
"""

import argparse
import json
import multiprocessing
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

SM = 90
PREFILL_M = (1024, 4096, 8192)
ROUNDS = 3
HOPPER = dict(BLOCK_K=64, THREADS=256, SWIZZLE=10, STAGES=4, FULL_ROW=True)


@dataclass(frozen=True)
class Case:
    label: str
    n: int  # output columns (for ACT, of SiLU x up: the weight has 2n rows)
    k: int
    act: int
    tile: dict  # the template's tile constexprs
    function: str = "gemm"
    template: str = "gemm.py"
    decode: bool = False  # timed at DECODE_ROWS over weight copies past the L2, in TB/s, plain and with PDL
    paired: bool = False  # timed after the norm launch (rows.py's add_rms_norm of X + X2's four planes), its rows


def decode_case(label: str, n: int, k: int, act: int, block_n: int, stages: int, threads: int, min_blocks: int,
                pdl: bool = True, template: str = "decode_gemm.py", block_k: int = 256, split: int = 1,
                swap_rows: int = 0, norm: bool = False, pre: int = 0, chains: int = 1,
                cluster: bool = False, halves: bool = False, partial: bool = False) -> Case:
    """A decode tile: decode_gemm.py's hand-specialised one (PDL: waits for the previous kernel after issuing its
    first weight stages; split: CTAs sharing a tile's K (cluster: as a thread block cluster, the sums met in shared
    memory); swap_rows: the weight tile as mma's A operand, that many rows as its B; norm: the add + RMSNorm inside,
    scaled as they land by a warpgroup of their own; pre: weight stages before the wait; chains: a single GEMM's
    stage as that many K slices into as many sums; halves: 8 weight rows and 4 rows a CTA, each over both K
    halves; partial: a split tile's fp32 planes, its output, left for the next kernel to add), or gemm.py's 16-row
    tile with rows by cp.async (a tuning candidate of the plan)."""
    tile = dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, THREADS=threads, MIN_BLOCKS=min_blocks)
    if template == "gemm.py":
        return Case(label, n, k, act, dict(tile, BLOCK_M=16, SWIZZLE=0, ASYNC_ROWS=True), decode=True)
    if norm:  # the rows' residual sum, RMSNorm and the sum's store in the tile, scaled as they land
        tile |= dict(NORM=True, ADD=True, WRITE_SUM=True, EPS=EPS, PRE=pre)
    tile |= dict(CHAINS=chains) if chains > 1 else {}
    tile |= dict(PRE=pre) if pre and not norm else {}
    tile |= dict(CLUSTER=True) if cluster else {}
    tile |= dict(HALVES=True) if halves else {}
    tile |= dict(PARTIAL=True) if partial else {}
    return Case(label, n, k, act, dict(tile, PDL=pdl, SPLIT=split, SWAP_ROWS=swap_rows), "decode_gemm", template,
                decode=True)


# the 4B model's decode GEMMs: (name, N, K, ACT)
DECODE_SHAPES = (("qkv", 6144, 2560, 0), ("o_proj", 2560, 4096, 0), ("gate_up", 9728, 2560, 1),
                 ("down", 2560, 9728, 0))
DECODE_ROWS = (1, 4, 16)
EPS = 1e-6
CASES = (
    Case("plain_128x256 N19456", 19456, 2560, 0, dict(BLOCK_M=128, BLOCK_N=256, **HOPPER)),
    Case("plain_256x128 N19456", 19456, 2560, 0, dict(BLOCK_M=256, BLOCK_N=128, **HOPPER)),
    Case("plain_128x128 N19456", 19456, 2560, 0, dict(BLOCK_M=128, BLOCK_N=128, **HOPPER)),
    Case("plain_128x256 N6144", 6144, 2560, 0, dict(BLOCK_M=128, BLOCK_N=256, **HOPPER)),
    Case("silu_merged_128x256", 9728, 2560, 1, dict(BLOCK_M=128, BLOCK_N=128, MERGED=True, **HOPPER)),
    Case("silu_128x128_rows", 9728, 2560, 1, dict(BLOCK_M=128, BLOCK_N=128, **HOPPER)),
    # decode: gemm.py's 16x32 tile of o_proj and down (the plan's until session 11), the anchor of the cases after it
    decode_case("o_proj gemm 16x32 s4", 2560, 4096, 0, 32, 4, 128, 2, template="gemm.py"),
    decode_case("down gemm 16x32 s4", 2560, 9728, 0, 32, 4, 128, 2, template="gemm.py"),
    # decode_gemm.py with PDL at the 4B model's shapes: 16x16 at 3 CTAs an SM as the plan's SiLU x up tile, split in
    # two for the 2560-wide GEMMs, and the widths and depths that measured slower (docs/BENCHMARKS.md, session 8)
    *[decode_case(f"{name} dg 16x{bn} s{st} b{mb} split{sp}", n, k, act, bn, st, th, mb, split=sp)
      for name, n, k, act in DECODE_SHAPES
      for bn, st, th, mb, sp in (((16, 3, 64, 3, 1), (16, 4, 64, 2, 1)) if act else
                                 ((16, 4, 64, 3, 1), (16, 4, 64, 3, 2), (32, 4, 128, 2, 1), (32, 2, 128, 4, 1),
                                  (64, 2, 128, 2, 1), (16, 6, 64, 2, 1), (16, 5, 64, 2, 1), (32, 4, 128, 1, 1)))
      if n % bn == 0 and (sp == 1 or n <= 4096)],
    # swapped: a stage holds 8 (or 16) rows, not 16, so two or three CTAs an SM keep 6-12 weight stages in flight
    *[decode_case(f"{name} swap{sw} 16x16 s{st} b{mb}", n, k, 0, 16, st, 32, mb, swap_rows=sw)
      for name, n, k, act in DECODE_SHAPES if not act
      for sw, st, mb in ((8, 9, 2), (8, 6, 3), (8, 12, 1), (16, 6, 2))],
    # the norm in the tile (swapped, 4 rows a CTA): a warpgroup of scalers scales each step's rows (+ X2's, loaded
    # into the stage's other 4 rows) by G in place as they land, into a bf16 high and low part, summing squares
    # beside; 1/rms scales the products last; pP: P weight stages before the PDL wait (0: all of them: QKV 10.0-10.3
    # us against 8.4-9.2 with 1-3, session 13); cC: C mma chains
    *[decode_case(f"{name} norm swap8 16x256 s{st} b{mb} p{pre} c{ch}", n, k, act, 16, st, 32, mb, swap_rows=8,
                  norm=True, pre=pre, chains=ch) for name, n, k, act in DECODE_SHAPES if name in ("qkv", "gate_up")
      for st, mb, pre, chs in (((5, 3, 0, (1, 2)), (5, 3, 1, (1, 2, 4)), (5, 3, 2, (1, 2, 4)), (5, 3, 3, (1, 2, 4)),
                                (4, 3, 2, (2,)), (8, 2, 2, (2,))) if not act else
                               ((3, 3, 0, (1,)), (3, 3, 1, (1,)), (3, 3, 2, (1,)), (4, 2, 1, (1,))))
      for ch in chs],
    decode_case("gate_up swap8 16x16 s3 b3", 9728, 2560, 1, 16, 3, 32, 3, swap_rows=8),
    # two (four) chains of mma.sync a consumer warp (each stage's K halves, quarters, into as many sums), as gate/up's
    # two GEMMs have; four not yet measured
    *[decode_case(f"{name} dg 16x{bn} s{st} b{mb} c{ch}", n, k, 0, bn, st, th, mb, chains=ch)
      for name, n, k, act in DECODE_SHAPES if not act
      for bn, st, th, mb in ((16, 4, 64, 3), (32, 4, 128, 2), (16, 6, 64, 2)) for ch in (2, 4)],
    *[decode_case(f"{name} swap8 16x16 s{st} b{mb} c{ch}", n, k, 0, 16, st, 32, mb, swap_rows=8, chains=ch)
      for name, n, k, act in DECODE_SHAPES if not act for st, mb in ((6, 3), (9, 2)) for ch in (2, 4)],
    *[decode_case(f"{name} swap16 16x16 s{st} b{mb} c{ch}", n, k, 0, 16, st, 32, mb, swap_rows=16, chains=ch)
      for name, n, k, act in DECODE_SHAPES if not act for st, mb in ((4, 3), (6, 2)) for ch in (2, 4)],
    # the narrow GEMMs (160 tiles of 16 for 132 SMs) split in two, now that chains lift a CTA's pace
    *[decode_case(f"{name} {kind} 16x16 s{st} b3 split2 c{ch}", n, k, 0, 16, st, th, 3, split=2, swap_rows=sw,
                  chains=ch)
      for name, n, k, act in DECODE_SHAPES if name in ("o_proj", "down")
      for kind, st, th, sw in (("dg", 4, 64, 0), ("swap8", 6, 32, 8)) for ch in (2, 4)],
    # o_proj in four K ranges: 640 CTAs, 4.85 an SM, each streaming its 16 x 1024 at once
    *[decode_case(f"o_proj {kind} 16x16 s{st} b{mb} split4 c4", 2560, 4096, 0, 16, st, th, mb, split=4, swap_rows=sw,
                  chains=4)
      for kind, st, mb, th, sw in (("swap8", 4, 4, 32, 8), ("swap8", 2, 6, 32, 8), ("swap8", 4, 3, 32, 8),
                                   ("dg", 4, 3, 64, 0), ("dg", 2, 5, 64, 0))],
    # PRE: a few weight stages before the PDL wait, the rest after the rows, so that weights are in flight while
    # the rows land (no faster than every stage ahead, session 11)
    *[decode_case(f"{name} {kind} 16x16 s{st} b{mb} c{ch} p{pre}", n, k, act, 16, st, th, mb, swap_rows=sw,
                  chains=ch if not act else 1, pre=pre)
      for name, n, k, act in DECODE_SHAPES
      for kind, st, mb, th, sw, ch, pres in (("swap8", 6, 3, 32, 8, 4, (2, 3, 4)), ("swap8", 9, 2, 32, 8, 4, (3, 5)),
                                             ("dg", 6, 2, 64, 0, 4, (2, 3)), ("dg", 4, 3, 64, 0, 2, (1, 2)),
                                             ("dg", 3, 3, 64, 0, 1, (1, 2)))
      if (kind == "dg" and st == 3) == bool(act) for pre in pres],
    # the narrow GEMMs' K at widths of exactly one and two 16-wide tiles an SM (132 and 264 CTAs): what 160 tiles
    # on 132 SMs cost
    *[decode_case(f"n{n}k{k} swap8 16x16 s6 b3 c4", n, k, 0, 16, 6, 32, 3, swap_rows=8, chains=4)
      for k in (4096, 9728) for n in (2112, 2560, 4224)],
    # the narrow GEMMs' K split over a cluster of 2 or 4 CTAs, the sums met in the first one's shared memory (no
    # planes, fence or ticket in global memory): 320 or 640 CTAs for their 160 tiles
    *[decode_case(f"{name} {kind} 16x16 s{st} b{mb} cluster{sp} c4", n, k, 0, 16, st, th, mb, split=sp,
                  swap_rows=sw, chains=4, cluster=True)
      for name, n, k, act in DECODE_SHAPES if name in ("o_proj", "down")
      for kind, st, mb, th, sw, sp in (("swap8", 6, 3, 32, 8, 2), ("swap8", 4, 4, 32, 8, 2), ("swap8", 3, 5, 32, 8, 4),
                                       ("dg", 4, 3, 64, 0, 2), ("dg", 3, 4, 64, 0, 2), ("dg", 2, 5, 64, 0, 4),
                                       ("swap16", 4, 3, 32, 16, 2), ("swap16", 6, 2, 32, 16, 2),
                                       ("swap8", 5, 3, 32, 8, 2))
      if k % (256 * sp) == 0],
    *[decode_case(f"{name} swap8 16x128 s12 b3 cluster2 c{ch}", n, k, 0, 16, 12, 32, 3, block_k=128, split=2,
                  swap_rows=8, chains=ch, cluster=True)
      for name, n, k, act in DECODE_SHAPES if name in ("o_proj", "down") for ch in (2, 4)],
    # wider weight tiles split over a cluster (2560 columns of 32 or 64 make 80 or 40 tiles, times 2-8 K ranges):
    # at 16 rows a 16-wide stage is half rows, which the L2 serves but which take half the ring from the weights
    *[decode_case(f"{name} {kind} 16x{bn}x{bk} s{st} b{mb} cluster{sp} c4", n, k, 0, bn, st, th, mb, block_k=bk,
                  split=sp, swap_rows=sw, chains=4, cluster=True)
      for name, n, k, act in DECODE_SHAPES if name in ("o_proj", "down")
      for kind, bn, bk, st, mb, th, sw, sp in (
          ("dg", 32, 256, 4, 2, 128, 0, 2), ("dg", 32, 128, 8, 2, 128, 0, 2),
          ("dg", 32, 128, 5, 3, 128, 0, 4), ("dg", 64, 128, 4, 2, 128, 0, 4), ("dg", 64, 64, 4, 3, 128, 0, 8),
          ("swap8", 32, 256, 3, 3, 32, 8, 4), ("swap8", 32, 128, 6, 3, 32, 8, 4), ("swap16", 32, 128, 5, 3, 32, 16, 4),
          ("swap8", 32, 128, 10, 2, 32, 8, 2))
      if k % (bk * sp) == 0],
    # o_proj's 21 MB in other shapes: more CTAs an SM (N = 6144: 384), none split (N = 5120: o_proj's 320 CTAs of 8
    # steps without the cluster's epilogue), fewer (4096: 256; 4608: 288)
    *[decode_case(f"n{n}k{k} {kind} 16x16 s{st} b3 c{ch}", n, k, 0, 16, st, th, 3, swap_rows=sw, chains=ch)
      for n, k in ((6144, 1792), (5120, 2048), (4608, 2304), (4096, 2560))
      for kind, st, th, sw, ch in (("swap8", 6, 32, 8, 4), ("dg", 4, 64, 0, 2))],
    # HALVES: a swapped tile of 8 weight rows over both K halves stacked (and 4 rows, each over both halves), so
    # that o_proj makes 320 CTAs of 8 steps without a split, as N = 5120, K = 2048 does (88% against 78-81%)
    *[decode_case(f"{name} swap8 halves 16x16 s{st} b3 c{ch}", n, k, 0, 16, st, 32, 3, swap_rows=8, chains=ch,
                  halves=True)
      for name, n, k, act in DECODE_SHAPES if not act for st, ch in ((6, 4), (6, 2), (5, 4))],
    # HALVES at the narrow GEMMs' 4 rows: K steps of 128, four CTAs an SM, PRE weight stages ahead of the rows
    *[decode_case(f"{name} swap8 halves 16x{bk} s{st} b{mb} c{ch}{f' p{pre}' if pre else ''}", n, k, 0, 16, st, 32, mb,
                  swap_rows=8, chains=ch, halves=True, block_k=bk, pre=pre)
      for name, n, k, act in DECODE_SHAPES if name in ("o_proj", "down")
      for bk, st, mb, ch, pre in ((128, 12, 3, 4, 0), (128, 10, 3, 4, 0), (128, 12, 3, 2, 0), (128, 8, 4, 4, 0),
                                  (256, 4, 4, 4, 0), (256, 3, 5, 4, 0), (256, 6, 3, 4, 2), (256, 6, 3, 4, 4),
                                  (256, 5, 3, 4, 3))],
    # 8 weight rows a CTA at 16 rows (o_proj's 320 CTAs, as the halved tile's, each stage two thirds rows): 7.2-7.5
    # us at 1, 4 and 16 rows alike, as the 160 CTAs of 16 weight rows (session 15)
    *[decode_case(f"{name} dg 16x8 s{st} b{mb} c{ch}{f' p{pre}' if pre else ''}", n, k, 0, 8, st, 32, mb, chains=ch,
                  pre=pre)
      for name, n, k, act in DECODE_SHAPES if name in ("o_proj", "down")
      for st, mb, ch, pre in ((6, 3, 4, 0), (6, 3, 2, 0), (5, 3, 4, 0), (8, 2, 4, 0), (6, 3, 4, 3), (4, 4, 4, 0))],
    # PARTIAL: a split tile's fp32 planes left for the next kernel (the norm launch) to add, so that the split
    # costs no fence, ticket or cluster barrier; wider weight tiles then cut a 16-row stage's share of rows
    *[decode_case(f"{name} dg 16x{bn}x{bk} s{st} b{mb} split{sp} partial t{th}", n, k, 0, bn, st, th, mb,
                  block_k=bk, split=sp, chains=4, partial=True)
      for name, n, k, act in DECODE_SHAPES if not act
      for bn, bk, st, mb, th, sp in ((16, 256, 6, 2, 64, 2), (16, 256, 4, 3, 64, 2), (16, 256, 4, 3, 64, 4),
                                     (32, 256, 3, 3, 64, 4), (32, 256, 3, 3, 128, 4), (32, 256, 2, 4, 64, 8),
                                     (64, 256, 2, 2, 128, 8), (64, 128, 4, 2, 128, 8), (32, 128, 6, 3, 64, 4),
                                     (32, 256, 3, 3, 64, 2), (32, 128, 6, 3, 64, 2), (64, 128, 4, 2, 128, 5),
                                     (64, 128, 4, 2, 128, 4), (16, 128, 8, 3, 64, 4))
      if k % (bk * sp) == 0 and 300 <= (n // bn) * sp <= 800],
    # the wide split tiles summed in the kernel after all: by the last CTA's ticket, or over a cluster
    *[decode_case(f"{name} dg 16x{bn}x{bk} s{st} b{mb} split{sp} {how} t{th}", n, k, 0, bn, st, th, mb, block_k=bk,
                  split=sp, chains=4, cluster=how == "cluster")
      for name, n, k, act in DECODE_SHAPES if not act
      for bn, bk, st, mb, th, sp in ((32, 256, 3, 3, 64, 4), (32, 128, 6, 3, 64, 4), (32, 128, 6, 3, 64, 2))
      for how in ("ticket", "cluster")
      if k % (bk * sp) == 0 and 300 <= (n // bn) * sp <= 800],
    # o_proj's wide partial tile, other shapes of it
    *[decode_case(f"o_proj dg 16x32x{bk} s{st} b{mb} split{sp} partial t{th} c{ch} p{pre}", 2560, 4096, 0, 32, st, th,
                  mb, block_k=bk, split=sp, chains=ch, partial=True, pre=pre)
      for bk, st, mb, th, sp, ch, pre in ((256, 3, 3, 32, 4, 4, 0), (256, 3, 3, 64, 4, 2, 0), (256, 3, 3, 64, 4, 4, 2),
                                          (256, 4, 2, 64, 4, 4, 0), (256, 4, 2, 64, 2, 4, 0), (512, 2, 2, 64, 4, 4, 0),
                                          (128, 5, 3, 64, 4, 4, 0),
                                          (128, 6, 3, 32, 4, 4, 0))],
)

# QKV's 16-row candidates alone and after the norm launch that adds down's planes (the slot's hop), and that launch:
# the hop costs 2.3-3.1 us at 16 rows whatever the tile; PRE (rows first after the wait) 2 is the fastest 16x16 tile
# alone (docs/BENCHMARKS.md, session 17)
NORM_LAUNCH = Case("norm launch K2560 planes", 2560, 2560, 0, dict(EPS=EPS, ADD=True, WRITE_SUM=True, THREADS=128,
                   PDL=True, PLANES=4), "add_rms_norm", "rows.py", decode=True)
PAIRED_BASES = ("qkv dg 16x16 s4 b3 c2", "qkv dg 16x32x128 s6 b3 split2 partial t64",
                "qkv dg 16x32x256 s3 b3 split2 partial t64", "qkv dg 16x16 s4 b3 c2 p1", "qkv dg 16x16 s4 b3 c2 p2",
                "qkv dg 16x16 s4 b3 c2 p3", "qkv dg 16x32x128 s6 b3 split2 partial t64 p2",
                "qkv dg 16x32x128 s6 b3 split2 partial t64 p4")
CASES += (decode_case("qkv dg 16x16 s4 b3 c2 p3", 6144, 2560, 0, 16, 4, 64, 3, chains=2, pre=3),)
CASES += tuple(decode_case(f"qkv dg 16x32x128 s6 b3 split2 partial t64 p{pre}", 6144, 2560, 0, 32, 6, 64, 3,
                           block_k=128, split=2, chains=4, partial=True, pre=pre) for pre in (2, 4))
CASES += (NORM_LAUNCH,) + tuple(Case(c.label + " after norm", c.n, c.k, c.act, c.tile, c.function, c.template,
                                     c.decode, paired=True) for c in CASES if c.label in PAIRED_BASES)


def launch_spec(case: Case):
    from pegainfer.backends.spec import GridDim, LaunchSpec, Param
    from pegainfer.backends.tilelang.plan import KERNELS

    if case.function == "add_rms_norm":  # the paired cases' norm launch: X + X2's planes, normed into A
        names = dict(X="x", X2="x2", G="g", S="s", Y="a")
        params = [Param(name, "tensor", value, "*bf16", aligned=True) for name, value in names.items()] + [
            Param("M", "int", "dim:tokens", "i32"), Param("P", "tensor", "xp", "*fp32", aligned=True),
            Param("PR", "int", "rows:xp", "i32")]
        return LaunchSpec(case.function, case.template, (KERNELS / case.template).read_text(), params,
                          dict(K=case.k, **case.tile), (GridDim(("tokens",)), GridDim((1,)), GridDim((1,))), 4, 1,
                          backend="tilelang")

    tensor = lambda name: Param(name, "tensor", name.lower(), "*bf16", aligned=True)  # noqa: E731
    prologue = [name for name, flag in (("X2", "ADD"), ("G", "NORM"), ("S", "WRITE_SUM")) if case.tile.get(flag)]
    params = [tensor(name) for name in ("A", *prologue, "W", "C")] + [Param("M", "int", "dim:tokens", "i32")]
    split = case.tile.get("SPLIT", 1)
    if case.tile.get("PARTIAL"):  # its planes are its output
        params = [tensor("A"), tensor("W"), Param("P", "tensor", "p", "*fp32", aligned=True), params[-1]]
    elif split > 1 and not case.tile.get("CLUSTER"):  # the split tile's fp32 planes and tickets
        params[-1:-1] = [Param("P", "tensor", "p", "*fp32", aligned=True),
                       Param("tickets", "tensor", "tickets", "*i32", aligned=True)]
    constexprs = dict(N=case.n, K=case.k, ACT=case.act, **case.tile)
    if case.function == "gemm":
        constexprs["RESIDUAL"] = False
    # a tile's rows and output columns: a normed tile's 8 rows are 4 and X2's (then the low halves), a halved tile's
    # 4 over both K halves, and its 16 weight rows 8 over both halves
    paired = 2 if case.tile.get("NORM") or case.tile.get("HALVES") else 1
    rows = case.tile.get("BLOCK_M", case.tile.get("SWAP_ROWS") or 16) // paired
    columns = case.tile["BLOCK_N"] // (2 if case.tile.get("HALVES") else 1)
    grid = (GridDim((case.n,), columns), GridDim(("tokens",), rows), GridDim((split,)))
    warpgroups = 1 + case.tile.get("NORM", False)  # decode_gemm.py's producer, and a normed tile's scalers
    threads = case.tile["THREADS"] + (128 * warpgroups if case.function == "decode_gemm" else 0)
    source = (KERNELS / case.template).read_text()
    return LaunchSpec(case.function, case.template, source, params, constexprs, grid,
                      threads // 32, case.tile["STAGES"], backend="tilelang")


def _compile(case: Case):
    from pegainfer.backends.tilelang.compiler import compile_launch

    try:
        return case, compile_launch(launch_spec(case), SM), None
    except Exception as error:  # a tile that does not compile is reported, not fatal
        return case, None, f"{type(error).__name__}: {str(error)[:300]}"


def prepare(out: Path, only: list[str] | None, decode: bool = False) -> None:
    cases = [c for c in CASES if (not only or c.label in only) and (c.decode or not decode)]
    if any(c.paired for c in cases) and NORM_LAUNCH not in cases:  # the launch a paired case is timed after
        cases.append(NORM_LAUNCH)
    out.mkdir(parents=True, exist_ok=True)
    index = []
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for i, (case, compiled, error) in enumerate(pool.map(_compile, cases)):
            if compiled is None:
                print(f"{case.label}: {error}", file=sys.stderr)
                continue
            cubin = f"case{i}.cubin"
            (out / cubin).write_bytes(compiled.cubin)
            (out / f"case{i}.cu").write_text(compiled.files["cu"])
            launch = asdict(launch_spec(case))
            del launch["source"]
            launch.update(key=cubin, cubin=cubin, symbol=compiled.function, shared=compiled.shared,
                          threads=compiled.threads, num_warps=compiled.threads // 32, params=compiled.abi,
                          cluster=list(compiled.cluster))
            index.append({"case": asdict(case), "launch": launch, "resources": compiled.resources})
            print(f"{case.label}: {compiled.resources}", flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))


def merge(out: Path, folders: list[Path]) -> None:
    """One probe folder of several prepared ones (each case once, by label), grouped by shape as `run` expects, so
    that cases compiled at different times are timed in one call."""
    out.mkdir(parents=True, exist_ok=True)
    entries = {}
    for folder in folders:
        for entry in json.loads((folder / "index.json").read_text()):
            entries.setdefault(entry["case"]["label"], (folder, entry))
    shapes = list(dict.fromkeys((e["case"]["n"], e["case"]["k"], e["case"]["act"]) for _, e in entries.values()))
    ordered = sorted(entries.values(), key=lambda fe: shapes.index((fe[1]["case"]["n"], fe[1]["case"]["k"],
                                                                    fe[1]["case"]["act"])))
    index = []
    for i, (folder, entry) in enumerate(ordered):
        cubin = f"case{i}.cubin"
        (out / cubin).write_bytes((folder / entry["launch"]["cubin"]).read_bytes())
        index.append(entry | {"launch": entry["launch"] | {"key": cubin, "cubin": cubin}})
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"{len(index)} cases from {len(folders)} folders into {out}")


def run(folder: Path, out: Path) -> None:
    import torch
    from kernels import Runner, rel_error, torch_time_us  # noqa: E402  (scripts/gpu/, beside this file)

    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(folder, {"kernels": []})
    results = []
    entries = json.loads((folder / "index.json").read_text())
    if any(e["case"]["decode"] for e in entries):
        run_decode([e for e in entries if e["case"]["decode"]], folder, out)
    for entry in entries:
        case, launch = entry["case"], entry["launch"]
        if case["decode"]:
            continue
        n, k, act = case["n"], case["k"], case["act"]
        w_rows = 2 * n if act else n
        for m in PREFILL_M:
            gen = torch.Generator(device="cuda").manual_seed(m)
            a = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            w = (torch.randn(w_rows, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16)
            c = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
            y = a.float() @ w.float().T
            ref = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if act else y
            row = {"case": case["label"], "m": m, "n": w_rows, "k": k}
            try:
                env, sizes = {"a": a, "w": w, "c": c}, {"tokens": m}
                runner.run([launch], env, sizes)
                runner.sync()
                row["rel_err"] = rel_error(c, ref)
                ours, theirs = [], []
                for _ in range(ROUNDS):  # alternated, best of each: the clock drifts with heat and power
                    ours.append(runner.time_us([launch], env, sizes))
                    theirs.append(torch_time_us(lambda: a @ w.T))
                row["us"], cublas_us = min(ours), min(theirs)
                row["tflops"] = 2 * m * w_rows * k / row["us"] / 1e6
                row["cublas_tflops"] = 2 * m * w_rows * k / cublas_us / 1e6
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
            results.append(row)
            (out / "probe.json").write_text(json.dumps(results, indent=1))
    print(f"{'case':<26} {'M':>5} {'N':>6} {'K':>5} {'rel err':>9} {'us':>8} {'TF/s':>6} {'cuBLAS':>7} {'share':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['case']:<26} {r['m']:>5} ERROR {r['error'][:80]}")
            continue
        print(f"{r['case']:<26} {r['m']:>5} {r['n']:>6} {r['k']:>5} {r['rel_err']:>9.2e} {r['us']:>8.1f} "
              f"{r['tflops']:>6.0f} {r['cublas_tflops']:>7.0f} {r['tflops'] / r['cublas_tflops']:>6.0%}")


def run_decode(entries: list[dict], folder: Path, out: Path) -> None:
    """Each decode case at DECODE_ROWS: checked against torch, then timed as a chain of 20 launches cycling through
    weight copies past the L2 (serving's stream), launched plainly and, where the kernel waits for its predecessor
    itself, with PDL; TB/s of weight read and its share of the copy bandwidth measured here. A paired case's chain
    is the norm launch (its K's) and the case, and its time theirs together."""
    import torch
    from kernels import L2_DEFEAT_BYTES, Runner, copy_bandwidth, rel_error  # noqa: E402

    plain, chained = Runner(folder, {"kernels": []}), Runner(folder, {"kernels": []}, pdl=True)
    copy = copy_bandwidth()
    results, weights = [], {}
    norms = {e["case"]["k"]: dict(e["launch"], pdl=True) for e in entries if e["case"]["function"] == "add_rms_norm"}
    for entry in entries:
        case, launch = entry["case"], entry["launch"]
        if case["function"] == "add_rms_norm":
            continue
        n, k, act = case["n"], case["k"], case["act"]
        w_rows = 2 * n if act else n
        if (w_rows, k) not in weights:  # one shape's copies at a time (the cases come grouped by shape)
            w = (torch.randn(w_rows, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
            weights = {(w_rows, k): [w] + [w.clone() for _ in range(L2_DEFEAT_BYTES // w.nbytes)]}
        copies = weights[(w_rows, k)]
        launch = dict(launch, pdl=bool(case["tile"].get("PDL")))
        chain = [norms[k], launch] if case.get("paired") else [launch]
        for rows in DECODE_ROWS:
            a = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            c = torch.zeros(rows, n, device="cuda", dtype=torch.bfloat16)
            prologue = norm_prologue(a) if case["tile"].get("NORM") else {}
            if case.get("paired"):
                prologue = planes_prologue(a)
            y = (prologue.pop("operand") if prologue else a.float()) @ copies[0].float().T
            ref = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if act else y
            row = {"case": case["label"], "rows": rows, "n": w_rows, "k": k}
            try:
                # split planes, NaN until written (a PARTIAL tile's are its output)
                scratch = {"p": torch.full((16 * case["tile"].get("SPLIT", 1), n), float("nan"), device="cuda"),
                           "tickets": torch.zeros(n // 8, device="cuda", dtype=torch.int32)}  # 2 row tiles
                residual = prologue.pop("residual", None)
                envs = [{"a": a, "w": w, "c": c} | prologue | scratch for w in copies]
                plain.run(chain, envs[0], {"tokens": rows})
                plain.sync()
                row["rel_err"] = rel_error(output(case, c, scratch["p"], rows), ref)
                row["ctas_per_sm"] = resident_ctas(plain.functions[launch["key"]], launch)
                if residual is not None:  # the residual sum the tile stores: x + x2, rounded once
                    row["sum_err"] = rel_error(prologue["s"], residual)
                row["us"] = plain.time_us(chain, envs, {"tokens": rows})
                if launch["pdl"]:
                    c.zero_()
                    scratch["p"].fill_(float("nan"))
                    if case.get("paired"):  # the norm launch's rows and sum, written again or caught unwritten
                        prologue["a"].fill_(float("nan"))
                        prologue["s"].zero_()
                    row["pdl_us"] = chained.time_us(chain, envs, {"tokens": rows})
                    chained.sync()
                    row["pdl_rel_err"] = rel_error(output(case, c, scratch["p"], rows), ref)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {error}"
                traceback.print_exc()
            results.append(row)
            (out / "decode_probe.json").write_text(json.dumps({"copy_tb_per_s": copy / 1e12, "rows": results},
                                                              indent=1))
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s; share = weight bytes / time / copy bandwidth")
    print(f"{'case':<56} {'rows':>4} {'CTA/SM':>6} {'rel err':>9} {'us':>7} {'share':>6} {'pdl us':>7} {'share':>6}")
    for r in results:
        if "error" in r:
            print(f"{r['case']:<56} {r['rows']:>4} ERROR {r['error'][:80]}")
            continue
        share = lambda us: r["n"] * r["k"] * 2 / (us * 1e-6) / copy  # noqa: E731
        pdl = f"{r['pdl_us']:>7.1f} {share(r['pdl_us']):>6.0%}" if "pdl_us" in r else ""
        residual = f" sum err {r['sum_err']:.1e}" if "sum_err" in r else ""
        print(f"{r['case']:<56} {r['rows']:>4} {r['ctas_per_sm']:>6} {r['rel_err']:>9.2e} {r['us']:>7.1f} "
              f"{share(r['us']):>6.0%} {pdl}{residual}")


def output(case: dict, c, planes, rows: int):
    """What the case computed: C, or a PARTIAL tile's planes ([SPLIT x 16, N] fp32) added in plane order, as the
    kernel after it would add them."""
    if not case["tile"].get("PARTIAL"):
        return c
    return planes.view(case["tile"]["SPLIT"], 16, -1)[:, :rows].sum(0)


def resident_ctas(function, launch: dict) -> int:
    """How many CTAs of the case an SM holds at once (the driver's count: shared memory, registers, threads), the
    figure a decode tile's stage count is chosen against."""
    from cuda.bindings import driver as cuda
    from pegainfer.runtime.cuda import driver

    query = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, launch["threads"], launch["shared"])
    return driver.check(query, f"cuOccupancyMaxActiveBlocksPerMultiprocessor({launch['symbol']})")


def norm_prologue(a, x2=None):
    """A normed case's other inputs (x2, random where not given; the norm's weight g, the sum's buffer s), the
    residual sum, and the GEMM's operand as Hugging Face makes it: RMSNorm of the bf16 sum a + x2, times g, in its
    roundings."""
    import torch
    from kernels import rms_normed  # noqa: E402  (scripts/gpu/, beside this file)

    if x2 is None:
        x2 = torch.randn_like(a, dtype=torch.float32).to(torch.bfloat16)
    g = (1 + 0.2 * torch.randn(a.shape[1], device=a.device)).to(torch.bfloat16)
    x = (a.float() + x2.float()).to(torch.bfloat16)
    return {"x2": x2, "g": g, "s": torch.zeros_like(a), "residual": x, "operand": rms_normed(x, g, EPS).float()}


def planes_prologue(a):
    """A paired case's norm launch's inputs: X (a), X2 as four fp32 planes (a split GEMM's, rows past `a`'s NaN:
    never read) and NaN as stored, and the rows' buffer (the case's A, which that launch writes); beside
    norm_prologue's, X2 being the planes' sum rounded to bf16."""
    import torch

    rows, k = a.shape
    planes = torch.full((64, k), float("nan"), device=a.device)
    for p in range(4):
        planes[16 * p:16 * p + rows] = torch.randn(rows, k, device=a.device) * 0.5
    x2 = planes[0:rows]
    for p in range(1, 4):  # in plane order, as the norm launch adds them
        x2 = x2 + planes[16 * p:16 * p + rows]
    return norm_prologue(a, x2.to(torch.bfloat16)) | {"x": a, "x2": torch.full_like(a, float("nan")),
                                                       "a": torch.zeros_like(a), "xp": planes}


def sustain(folder: Path, out: Path, m: int, seconds: float) -> None:
    """Each case and cuBLAS's plain GEMM of its shape at M = m, replayed back to back for `seconds` with the SM
    clock and board power sampled (kernels.py's --sustain, for the probe's cases)."""
    import torch
    from kernels import PowerSampler, Runner, torch_graph  # noqa: E402

    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(folder, {"kernels": []})
    power = PowerSampler(out / "smi.csv")
    results = []
    for entry in json.loads((folder / "index.json").read_text()):
        case, launch = entry["case"], entry["launch"]
        if case["decode"]:  # a few rows: nothing to sustain at the power cap
            continue
        n, k, act = case["n"], case["k"], case["act"]
        w_rows = 2 * n if act else n
        flops = 20 * 2 * m * w_rows * k  # a replay: 20 runs
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        w = (torch.randn(w_rows, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
        c = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
        replay = runner.replayer([launch], {"a": a, "w": w, "c": c}, {"tokens": m})
        results.append({"what": case["label"]} | power.measure(replay, runner.sync, seconds, flops))
        graph = torch_graph([lambda: a @ w.T])
        results.append({"what": f"cublas {m}x{w_rows}x{k}"} | power.measure(graph.replay, torch.cuda.synchronize,
                                                                          seconds, flops))
    power.stop()
    print(f"{'what':<28} {'TF/s':>6} {'SM MHz':>7} {'W':>6} {'C':>4}")
    for r in results:
        print(f"{r['what']:<28} {r['sustained_tflops']:>6.0f} {r['mhz']:>7.0f} {r['watts']:>6.0f} {r['celsius']:>4.0f}")
    (out / "sustain.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare")
    prep.add_argument("--out", type=Path, required=True)
    prep.add_argument("--only", nargs="*", help="only the cases of these labels")
    prep.add_argument("--decode", action="store_true", help="only the decode cases")
    join = sub.add_parser("merge", help="one folder of several prepared ones, to time them in one call")
    join.add_argument("--out", type=Path, required=True)
    join.add_argument("folders", type=Path, nargs="+")
    go = sub.add_parser("run")
    go.add_argument("--dir", type=Path, required=True)
    go.add_argument("--out", type=Path, required=True)
    go.add_argument("--sustain", type=float, default=0.0,
                    help="instead: each case and cuBLAS replayed for this many seconds at M = 8192, with the SM "
                         "clock and board power sampled")
    args = parser.parse_args()
    if args.command == "prepare":
        unknown = set(args.only or ()) - {c.label for c in CASES}
        if unknown:
            parser.error(f"--only: no case labelled {sorted(unknown)}; the cases: {[c.label for c in CASES]}")
        if args.decode and args.only and not any(c.decode for c in CASES if c.label in args.only):
            parser.error(f"no case to compile: --only {args.only} with --decode selects none")
        prepare(args.out, args.only, args.decode)
    elif args.command == "merge":
        unprepared = [str(f) for f in args.folders if not (f / "index.json").is_file()]
        if unprepared:
            parser.error(f"merge: no index.json (a `prepare --out` folder) in {unprepared}")
        if args.out.resolve() in {f.resolve() for f in args.folders}:
            parser.error(f"merge: --out {args.out} is one of the folders merged (its cubins would be overwritten)")
        merge(args.out, args.folders)
    elif args.sustain < 0:
        parser.error(f"--sustain: seconds must not be negative, got {args.sustain}")
    elif args.sustain:
        sustain(args.dir, args.out, PREFILL_M[-1], args.sustain)
    else:
        run(args.dir, args.out)

if __name__ == "__main__":
    main()
