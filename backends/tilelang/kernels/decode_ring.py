"""What the decode GEMM forms share: a ring of STAGES shared-memory stages that a producer warpgroup fills (weight
tiles by TMA, the step's rows by predicated cp.async, rows past M zero-filled and never read) and consumer warps
drain with mma.sync, each stage handed back only once every GEMM that reads it is done. With PDL the producer issues
its first weight stages before it waits for the previous kernel: weights never depend on it (the planner passes
only parameters), so a chain of decode GEMMs keeps the weights streaming across the launch boundary.

The forms (decode_tile.py, decode_normed.py, decode_halved.py, decode_planes.py) build their macros from a Ring;
the plan's cache key covers this file's text with each form's (plan.py's `_source`)."""

from dataclasses import dataclass
from typing import Any

import tilelang.language as T

BF16 = T.bfloat16
ROWS = 16  # mma.sync's M
PRODUCER = 128  # the producer warpgroup's threads, after the THREADS consumers
CONSUMERS_BARRIER = 1  # a named barrier of the consumers alone (0 is the whole CTA's)


@dataclass(frozen=True)
class Ring:
    """One CTA's walk over K, as its producer and consumers share it. rows: the step's rows a stage holds (ROWS,
    or 8 where the weight tile is mma's A operand: `swapped`); steps: the K steps a CTA walks; rows_first: each
    step's rows go out before the weight stages not issued ahead of the wait (rows queued behind a full SM's worth
    of weight loads wait for them)."""
    N: int
    K: int
    ACT: int  # 1: SiLU(x @ Wg^T) * (x @ Wu^T) over a merged [2N, K] weight, two GEMMs a stage
    BLOCK_N: int
    BLOCK_K: int
    STAGES: int
    THREADS: int  # the consumers'
    MIN_BLOCKS: int  # CTAs an SM must hold: caps the registers
    CHAINS: int  # a single GEMM's stage in K slices into as many sums: independent mma chains
    PDL: bool
    PRE: int  # weight stages issued before the wait (0: all the ring holds)
    rows: int
    swapped: bool
    steps: int
    rows_first: bool

    def __post_init__(self) -> None:
        assert self.PRE <= self.STAGES, f"PRE: weight stages issued before the rows, at most {self.STAGES}, got " \
            f"{self.PRE}"
        assert self.CHAINS in (1, 2, 4) and (self.CHAINS == 1 or not self.ACT), "CHAINS splits a single GEMM's " \
            f"stages in 1, 2 or 4 (SiLU x up has two GEMMs already), got {self.CHAINS} with ACT={self.ACT}"

    @property
    def ahead(self) -> int:
        """Weight stages issued before the first rows (and the PDL wait)."""
        return min(self.PRE or self.STAGES, self.steps)

    @property
    def sums_shape(self) -> tuple[int, int]:
        """An accumulator's: [ROWS, BLOCK_N], or [BLOCK_N, rows] swapped."""
        return (self.BLOCK_N, self.rows) if self.swapped else (ROWS, self.BLOCK_N)

    def column(self, bz, k):
        """The first column of a CTA's k-th step (bz: its K range, where K is split)."""
        return (bz * self.steps + k) * self.BLOCK_K


@dataclass(frozen=True)
class Stages:
    """A tile's ring and accumulators (alloc_stages). u_s: up's weight stages (ACT); up: the up GEMM's sums (ACT),
    or those of a stage's second K slice (CHAINS); third, fourth: those of its others (CHAINS = 4)."""
    a_s: Any
    w_s: Any
    u_s: Any
    w_full: Any
    a_full: Any
    empty: Any
    acc: Any
    up: Any
    third: Any
    fourth: Any


def allocator(ring: Ring):
    @T.macro
    def alloc_stages():
        a_s = T.alloc_shared((ring.STAGES, ring.rows, ring.BLOCK_K), BF16)
        w_s = T.alloc_shared((ring.STAGES, ring.BLOCK_N, ring.BLOCK_K), BF16)
        u_s = None
        if ring.ACT:
            u_s = T.alloc_shared((ring.STAGES, ring.BLOCK_N, ring.BLOCK_K), BF16)
        w_full = T.alloc_barrier([PRODUCER] * ring.STAGES)
        a_full = T.alloc_barrier([PRODUCER] * ring.STAGES)
        empty = T.alloc_barrier([ring.THREADS] * ring.STAGES)
        acc = T.alloc_fragment(ring.sums_shape, T.float32)
        up, third, fourth = None, None, None
        if ring.ACT or ring.CHAINS > 1:
            up = T.alloc_fragment(ring.sums_shape, T.float32)
        if ring.CHAINS == 4:
            third = T.alloc_fragment(ring.sums_shape, T.float32)
            fourth = T.alloc_fragment(ring.sums_shape, T.float32)
        return Stages(a_s, w_s, u_s, w_full, a_full, empty, acc, up, third, fourth)

    return alloc_stages


def weight_loader(ring: Ring):
    @T.macro
    def load_weights(W, b, bx, bz, k):
        """Step k's weight tile (and up's, for SiLU x up) by TMA into its stage."""
        stage, col = k % ring.STAGES, ring.column(bz, k)
        T.tma_copy(W[bx * ring.BLOCK_N:(bx + 1) * ring.BLOCK_N, col:col + ring.BLOCK_K], b.w_s[stage, :, :],
                   barrier=b.w_full[stage])
        if ring.ACT:
            T.tma_copy(W[ring.N + bx * ring.BLOCK_N:ring.N + (bx + 1) * ring.BLOCK_N, col:col + ring.BLOCK_K],
                       b.u_s[stage, :, :], barrier=b.w_full[stage])
        T.mbarrier_arrive(b.w_full[stage])

    return load_weights


def row_loader(ring: Ring):
    @T.macro
    def load_rows(A, X2, a_s, a_full, by, bz, k):
        """Step k's ROWS rows of the step by predicated cp.async (rows past M zero-filled)."""
        stage, col = k % ring.STAGES, ring.column(bz, k)
        T.async_copy(A[by * ring.rows:(by + 1) * ring.rows, col:col + ring.BLOCK_K], a_s[stage, :, :])
        T.cp_async_barrier_noinc(a_full[stage])  # arrives once all this thread's copies so far have landed

    return load_rows


def producer(ring: Ring, load_rows):
    """(issue_ahead, stream): the producer's weight stages before the wait, then the wait and the walk over K.
    `load_rows` is the form's (A, X2, a_s, barrier, by, bz, k) macro; stream's `rows_full` is the barrier the rows
    arrive on (the consumers' a_full, or the stage of a form that rewrites the rows before the consumers read
    them)."""
    load_weights = weight_loader(ring)

    @T.macro
    def issue_ahead(W, b, bx, bz):
        for k in T.serial(ring.ahead):
            load_weights(W, b, bx, bz, k)

    @T.macro
    def stream(A, X2, W, b, rows_full, bx, by, bz):
        if ring.PDL:
            T.pdl_sync()
        if ring.rows_first:  # the rows first, then the weight stages not issued before the wait
            for k in T.serial(ring.steps):
                if k >= ring.STAGES:
                    T.mbarrier_wait_parity(b.empty[k % ring.STAGES], (k // ring.STAGES + 1) % 2)
                load_rows(A, X2, b.a_s, rows_full, by, bz, k)
                if k >= ring.ahead:
                    load_weights(W, b, bx, bz, k)
        else:
            for k in T.serial(ring.steps):
                if k >= ring.STAGES:
                    T.mbarrier_wait_parity(b.empty[k % ring.STAGES], (k // ring.STAGES + 1) % 2)
                    load_weights(W, b, bx, bz, k)
                load_rows(A, X2, b.a_s, rows_full, by, bz, k)

    return issue_ahead, stream


def multiplier(ring: Ring):
    """The consumers' walk: every stage's GEMMs once its weights and rows are in, the stage handed back after them
    all, and the chains' sums added into `acc`."""
    @T.macro
    def multiply_part(a_s, w_s, sums, stage, part):
        """The stage's part-th K slice (of CHAINS) of rows times weights into `sums`: one of as many independent
        chains of mma.sync (with one, each mma waits on the previous one's result, and that latency sets the
        pace)."""
        lo, hi = part * ring.BLOCK_K // ring.CHAINS, (part + 1) * ring.BLOCK_K // ring.CHAINS
        if ring.swapped:
            T.gemm(w_s[stage, :, lo:hi], a_s[stage, :, lo:hi], sums, transpose_B=True)
        else:
            T.gemm(a_s[stage, :, lo:hi], w_s[stage, :, lo:hi], sums, transpose_B=True)

    @T.macro
    def multiply_all(b):
        T.clear(b.acc)
        if ring.ACT or ring.CHAINS > 1:
            T.clear(b.up)
        if ring.CHAINS == 4:
            T.clear(b.third)
            T.clear(b.fourth)
        for k in T.serial(ring.steps):
            T.mbarrier_wait_parity(b.w_full[k % ring.STAGES], (k // ring.STAGES) % 2)
            T.mbarrier_wait_parity(b.a_full[k % ring.STAGES], (k // ring.STAGES) % 2)
            multiply_part(b.a_s, b.w_s, b.acc, k % ring.STAGES, 0)
            if ring.ACT:  # up's GEMM over the same rows
                multiply_part(b.a_s, b.u_s, b.up, k % ring.STAGES, 0)
            if ring.CHAINS > 1:
                multiply_part(b.a_s, b.w_s, b.up, k % ring.STAGES, 1)
            if ring.CHAINS == 4:
                multiply_part(b.a_s, b.w_s, b.third, k % ring.STAGES, 2)
                multiply_part(b.a_s, b.w_s, b.fourth, k % ring.STAGES, 3)
            T.mbarrier_arrive(b.empty[k % ring.STAGES])  # after the GEMMs: all read the same rows
        if ring.CHAINS == 2:
            for i, j in T.Parallel(*b.acc.shape):
                b.acc[i, j] += b.up[i, j]
        if ring.CHAINS == 4:
            for i, j in T.Parallel(*b.acc.shape):
                b.acc[i, j] += b.up[i, j] + b.third[i, j] + b.fourth[i, j]

    return multiply_all


def starter(ring: Ring):
    @T.macro
    def start():
        """Before the roles split: the register cap for MIN_BLOCKS CTAs an SM (no setmaxnreg), and with PDL the
        next kernel let launch at once."""
        T.annotate_min_blocks_per_sm(ring.MIN_BLOCKS)
        T.disable_warp_group_reg_alloc()
        if ring.PDL:
            T.pdl_trigger()

    return start
