"""Causal grouped-query attention for prefill-shaped steps, flash-attention style, over the packed queries and
the paged KV cache of ir/ops/attention.py: one program per (query tile, query head, sequence), as many query
tiles as the step has tokens (those past a sequence's queries exit at once); key tiles are
gathered through the block table into shared memory, S = Q K^T and O += P V run on the tensor cores (wgmma on
sm_90a), with an online softmax in base 2 between them. `attention` is the plain form (any SM TileLang serves);
`attention_ws` overlaps the softmax, the gather and the tensor cores on sm_90a."""

from dataclasses import dataclass
from typing import Any

import tilelang.language as T

BF16 = T.bfloat16
LOG2E = 1.4426950408889634


def _tile_io(BLOCK_M: int, HD: int):
    """The two kernels' shared ends: the query tile into shared memory (rows past the sequence's queries zero)
    with the softmax state reset, and the normalised rows out (only the sequence's own)."""
    neg_inf = -T.infinity(T.float32)

    @T.macro
    def load_queries(Q, q_s, acc, l, m, start, q0, q_len, head):
        for i, d in T.Parallel(BLOCK_M, HD):
            q_s[i, d] = T.if_then_else(q0 + i < q_len, Q[start + q0 + i, head, d], T.cast(0, BF16))
        T.fill(acc, 0)
        T.fill(l, 0)
        T.fill(m, neg_inf)

    @T.macro
    def write_rows(acc, l, o_s, O, start, q0, q_len, head):
        for i, d in T.Parallel(BLOCK_M, HD):
            o_s[i, d] = T.cast(acc[i, d] / l[i], BF16)
        for i, d in T.Parallel(BLOCK_M, HD):
            if q0 + i < q_len:
                O[start + q0 + i, head, d] = o_s[i, d]

    return load_queries, write_rows


def attention(HEADS: int, KV_HEADS: int, HD: int, CACHE_BLOCK: int, SCALE: float, BLOCK_M: int, BLOCK_N: int,
              STAGES: int, THREADS: int):
    tokens, batch, blocks, max_blocks = (T.dynamic(name) for name in ("M", "B", "NB", "MAXB"))
    group = HEADS // KV_HEADS
    scale = SCALE * LOG2E
    neg_inf = -T.infinity(T.float32)
    load_queries, write_rows = _tile_io(BLOCK_M, HD)

    @T.prim_func
    def attention(Q: T.Tensor((tokens, HEADS, HD), BF16), KC: T.Tensor((blocks, CACHE_BLOCK, KV_HEADS, HD), BF16),
                  VC: T.Tensor((blocks, CACHE_BLOCK, KV_HEADS, HD), BF16),
                  TABLES: T.Tensor((batch, max_blocks), T.int32), STARTS: T.Tensor((batch,), T.int32),
                  Q_LENS: T.Tensor((batch,), T.int32), CTX_LENS: T.Tensor((batch,), T.int32),
                  O: T.Tensor((tokens, HEADS, HD), BF16)):
        with T.Kernel(T.ceildiv(tokens, BLOCK_M), HEADS, batch, threads=THREADS) as (bx, head, seq):
            q_s = T.alloc_shared((BLOCK_M, HD), BF16)
            k_s = T.alloc_shared((BLOCK_N, HD), BF16)
            v_s = T.alloc_shared((BLOCK_N, HD), BF16)
            o_s = T.alloc_shared((BLOCK_M, HD), BF16)
            s = T.alloc_fragment((BLOCK_M, BLOCK_N), T.float32)
            p = T.alloc_fragment((BLOCK_M, BLOCK_N), BF16)
            acc = T.alloc_fragment((BLOCK_M, HD), T.float32)
            m = T.alloc_fragment((BLOCK_M,), T.float32)
            m_prev = T.alloc_fragment((BLOCK_M,), T.float32)
            rescale = T.alloc_fragment((BLOCK_M,), T.float32)
            row_sum = T.alloc_fragment((BLOCK_M,), T.float32)
            l = T.alloc_fragment((BLOCK_M,), T.float32)
            kv_head = head // group
            tile = T.ceildiv(tokens, BLOCK_M) - 1 - bx  # the longest tiles (last queries) start first
            start = STARTS[seq]
            q_len = Q_LENS[seq]
            ctx = CTX_LENS[seq]
            q0 = tile * BLOCK_M
            first_pos = ctx - q_len + q0  # the position of the tile's first query
            kv_end = T.min(ctx, first_pos + BLOCK_M)
            if q0 < q_len:
                load_queries(Q, q_s, acc, l, m, start, q0, q_len, head)
                for k in T.Pipelined(T.ceildiv(kv_end, BLOCK_N), num_stages=STAGES):
                    for j, d in T.Parallel(BLOCK_N, HD):
                        pos = T.min(k * BLOCK_N + j, kv_end - 1)  # clamped: masked below, read in bounds
                        k_s[j, d] = KC[TABLES[seq, pos // CACHE_BLOCK], pos % CACHE_BLOCK, kv_head, d]
                    T.clear(s)
                    T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                        s[i, j] = T.if_then_else((k * BLOCK_N + j <= first_pos + i) & (k * BLOCK_N + j < kv_end),
                                                 s[i, j] * scale, neg_inf)
                    T.copy(m, m_prev)
                    T.reduce_max(s, m, dim=1, clear=False)
                    for i in T.Parallel(BLOCK_M):
                        rescale[i] = T.exp2(m_prev[i] - m[i])
                    for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                        s[i, j] = T.exp2(s[i, j] - m[i])
                    T.reduce_sum(s, row_sum, dim=1)
                    for i in T.Parallel(BLOCK_M):
                        l[i] = l[i] * rescale[i] + row_sum[i]
                    for i, d in T.Parallel(BLOCK_M, HD):
                        acc[i, d] *= rescale[i]
                    T.copy(s, p)
                    for j, d in T.Parallel(BLOCK_N, HD):
                        pos = T.min(k * BLOCK_N + j, kv_end - 1)
                        v_s[j, d] = VC[TABLES[seq, pos // CACHE_BLOCK], pos % CACHE_BLOCK, kv_head, d]
                    T.gemm(p, v_s, acc, policy=T.GemmWarpPolicy.FullRow)
                write_rows(acc, l, o_s, O, start, q0, q_len, head)

    return attention


def _overlap_steps(BLOCK_M: int, BLOCK_N: int, CACHE_BLOCK: int, scale: float, unroll: int | None = None):
    """attention_ws's pieces: a key tile's pages (K or V) by cp.async into one half of a double buffer
    (`unroll` pages at a time: the warp-specialised producer has 24 registers, too few for all 8 pages' addresses),
    and the tile's online softmax, which leaves the accumulator alone so that it can run while O += P V is still in
    flight on the tensor cores."""
    neg_inf = -T.infinity(T.float32)
    pages = BLOCK_N // CACHE_BLOCK

    @T.macro
    def load_tile(cache, buf, tile, TABLES, seq, kv_head, last_page):
        # pages past the context's last are clamped to it: masked, read in bounds
        for j in T.unroll(pages, unroll_factor=unroll):
            T.async_copy(cache[TABLES[seq, T.min(tile * pages + j, last_page)], :, kv_head, :],
                         buf[tile % 2, j * CACHE_BLOCK:(j + 1) * CACHE_BLOCK, :])

    @T.macro
    def online_softmax(s, m, m_prev, rescale, row_sum, l):
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)
        for i in T.Parallel(BLOCK_M):
            rescale[i] = T.exp2(m_prev[i] * scale - m[i] * scale)
        for i, j in T.Parallel(BLOCK_M, BLOCK_N):
            s[i, j] = T.exp2(s[i, j] * scale - m[i] * scale)
        T.reduce_sum(s, row_sum, dim=1)
        for i in T.Parallel(BLOCK_M):
            l[i] = l[i] * rescale[i] + row_sum[i]

    # The causal mask (and the context's end) only on a tile crossing the diagonal. The softmax is written in
    # both arms on purpose: ptxas hoists a wgmma wait to the top of its basic block, so the wait for P V after this
    # macro would otherwise land before the softmax (seen in the SASS) and serialise it behind the product; with
    # the branch, the wait stays in the join block, after the softmax.
    @T.macro
    def softmax(s, m, m_prev, rescale, row_sum, l, tile, first_pos, kv_end):
        if (tile + 1) * BLOCK_N > first_pos + 1:  # a key of this tile lies past some query's position
            for i, j in T.Parallel(BLOCK_M, BLOCK_N):
                s[i, j] = T.if_then_else((tile * BLOCK_N + j <= first_pos + i) & (tile * BLOCK_N + j < kv_end),
                                         s[i, j], neg_inf)
            online_softmax(s, m, m_prev, rescale, row_sum, l)
        else:
            online_softmax(s, m, m_prev, rescale, row_sum, l)

    return load_tile, softmax


def _overlap_products(BLOCK_M: int, BLOCK_N: int, HD: int, THREADS: int):
    """attention_ws's async wgmma (T.wgmma_gemm, no implicit wait), each warpgroup on its 64 query rows:
    S = Q K^T alone (the caller decides when to wait for it), O += P V issued on the accumulator rescaled to the last
    tile's maximum, and the last P V waited for. Each wait is followed by a register fence on the accumulator it
    releases, so that the C++ compiler cannot move the reads above it."""
    rows = T.GemmWarpPolicy.FullRow
    s_regs, o_regs = BLOCK_M * BLOCK_N // THREADS, BLOCK_M * HD // THREADS  # a thread's share of S and of O

    @T.macro
    def scores(q_s, k_buf, s):
        T.wgmma_gemm(q_s, k_buf, s, transpose_B=True, policy=rows, clear_accum=True)

    @T.macro
    def wait_scores(s, pending):  # groups complete in order: pending 1 leaves the P V issued after S running
        T.wait_wgmma(pending)
        T.warpgroup_fence_operand(s, num_regs=s_regs)

    @T.macro
    def rescaled_pv(acc, rescale, p, v_buf):
        for i, d in T.Parallel(BLOCK_M, HD):  # O scaled to the last tile's maximum, under S's product
            acc[i, d] *= rescale[i]
        T.wgmma_gemm(p, v_buf, acc, policy=rows)

    @T.macro
    def wait_pv(acc):
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc, num_regs=o_regs)

    return scores, wait_scores, rescaled_pv, wait_pv


@dataclass(frozen=True)
class OverlapTiles:
    """attention_ws's shared memory, barriers and fragments (allocated by `_overlap_tiles`): the query tile, the K and
    V rings of two stages with their full and empty barriers, the scores S and probabilities P, the accumulator O
    and the online softmax's state."""
    q_s: Any
    k_s: Any
    v_s: Any
    k_full: Any
    v_full: Any
    k_empty: Any
    v_empty: Any
    s: Any
    p: Any
    acc: Any
    m: Any
    m_prev: Any
    rescale: Any
    row_sum: Any
    l: Any


def _overlap_tiles(BLOCK_M: int, BLOCK_N: int, HD: int, THREADS: int):
    @T.macro
    def alloc_tiles():
        q_s = T.alloc_shared((BLOCK_M, HD), BF16)
        k_s = T.alloc_shared((2, BLOCK_N, HD), BF16)
        v_s = T.alloc_shared((2, BLOCK_N, HD), BF16)
        k_full = T.alloc_barrier([128, 128])
        v_full = T.alloc_barrier([128, 128])
        k_empty = T.alloc_barrier([THREADS, THREADS])
        v_empty = T.alloc_barrier([THREADS, THREADS])
        s = T.alloc_fragment((BLOCK_M, BLOCK_N), T.float32)
        p = T.alloc_fragment((BLOCK_M, BLOCK_N), BF16)
        acc = T.alloc_fragment((BLOCK_M, HD), T.float32)
        m = T.alloc_fragment((BLOCK_M,), T.float32)
        m_prev = T.alloc_fragment((BLOCK_M,), T.float32)
        rescale = T.alloc_fragment((BLOCK_M,), T.float32)
        row_sum = T.alloc_fragment((BLOCK_M,), T.float32)
        l = T.alloc_fragment((BLOCK_M,), T.float32)
        return OverlapTiles(q_s, k_s, v_s, k_full, v_full, k_empty, v_empty, s, p, acc, m, m_prev, rescale, row_sum, l)

    return alloc_tiles


def _overlap_roles(BLOCK_M: int, BLOCK_N: int, HD: int, CACHE_BLOCK: int, SCALE: float, THREADS: int):
    """attention_ws's two roles: the producer warpgroup's gather of every K and V tile into the rings, and the
    consumers' walk over the key tiles with the softmax under the P V product."""
    load_queries, write_rows = _tile_io(BLOCK_M, HD)
    load_tile, softmax = _overlap_steps(BLOCK_M, BLOCK_N, CACHE_BLOCK, SCALE * LOG2E, unroll=2)
    scores, wait_scores, rescaled_pv, wait_pv = _overlap_products(BLOCK_M, BLOCK_N, HD, THREADS)

    @T.macro
    def produce(cache, buf, full, empty, tile, TABLES, seq, kv_head, last_page):
        T.mbarrier_wait_parity(empty[tile % 2], (tile // 2) % 2 ^ 1)  # a fresh barrier's parity 1 counts as done
        load_tile(cache, buf, tile, TABLES, seq, kv_head, last_page)
        T.cp_async_barrier_noinc(full[tile % 2])

    @T.macro
    def consume(full, tile):
        T.mbarrier_wait_parity(full[tile % 2], (tile // 2) % 2)
        T.fence_proxy_async()

    @T.macro
    def gather(KC, VC, b, TABLES, seq, kv_head, last_page, n):
        """K_k, then V_{k-1}: the consumers' order of use (S_k, then P_{k-1} V_{k-1})."""
        T.dec_max_nreg(24)
        for k in T.serial(n):
            produce(KC, b.k_s, b.k_full, b.k_empty, k, TABLES, seq, kv_head, last_page)
            if k > 0:
                produce(VC, b.v_s, b.v_full, b.v_empty, k - 1, TABLES, seq, kv_head, last_page)
        produce(VC, b.v_s, b.v_full, b.v_empty, n - 1, TABLES, seq, kv_head, last_page)
        # no copy of this thread's still in flight when it exits
        T.mbarrier_wait_parity(b.v_full[(n - 1) % 2], ((n - 1) // 2) % 2)

    @T.macro
    def attend(Q, O, b, start, q0, q_len, head, first_pos, kv_end, n):
        T.inc_max_nreg(240)
        load_queries(Q, b.q_s, b.acc, b.l, b.m, start, q0, q_len, head)
        consume(b.k_full, 0)
        scores(b.q_s, b.k_s[0, :, :], b.s)
        wait_scores(b.s, 0)
        T.mbarrier_arrive(b.k_empty[0])
        softmax(b.s, b.m, b.m_prev, b.rescale, b.row_sum, b.l, 0, first_pos, kv_end)
        T.copy(b.s, b.p)
        for k in T.serial(1, n):
            consume(b.k_full, k)
            scores(b.q_s, b.k_s[k % 2, :, :], b.s)
            consume(b.v_full, k - 1)
            rescaled_pv(b.acc, b.rescale, b.p, b.v_s[(k - 1) % 2, :, :])
            wait_scores(b.s, 1)  # S_k is done; P_{k-1} V_{k-1} may still run
            T.mbarrier_arrive(b.k_empty[k % 2])
            softmax(b.s, b.m, b.m_prev, b.rescale, b.row_sum, b.l, k, first_pos, kv_end)
            wait_pv(b.acc)
            T.mbarrier_arrive(b.v_empty[(k - 1) % 2])
            T.copy(b.s, b.p)
        consume(b.v_full, n - 1)
        rescaled_pv(b.acc, b.rescale, b.p, b.v_s[(n - 1) % 2, :, :])
        wait_pv(b.acc)
        write_rows(b.acc, b.l, b.q_s, O, start, q0, q_len, head)

    return gather, attend


def attention_ws(HEADS: int, KV_HEADS: int, HD: int, CACHE_BLOCK: int, SCALE: float, BLOCK_M: int, BLOCK_N: int,
                 THREADS: int):
    """The same attention with FlashAttention-3's two overlaps. Within a warpgroup (64 query rows each) the
    softmax runs under the tensor cores: the GEMMs are issued as async wgmma, and step k issues S_k = Q K_k^T,
    rescales O to tile k - 1's maximum while that runs, issues O += P_{k-1} V_{k-1}, waits for S_k only
    (wait_wgmma(1): groups complete in order) and runs S_k's softmax while P V is on the tensor cores, then waits
    for P V before overwriting P with P_k. Key 0 is visible to every row, so the running maximum is finite from
    tile 0 on and a masked key's exp2 is 0. Across warpgroups the loads are split off: a producer warpgroup added to
    the THREADS consumers gathers the K and V pages by cp.async into two-stage rings, each stage guarded by a full
    mbarrier (the producer's 128 threads arrive through cp.async.mbarrier.arrive.noinc, so the phase completes when
    their copies have landed, with no wait in the producer) and an empty one (every consumer thread arrives once it
    is done reading the stage). The consumers wait only on the stage they read: no block-wide barrier in the loop,
    so the warpgroups drift apart and neither issues loads. setmaxnreg gives the producer 24 registers and the
    consumers 240 (128 x 24 + 256 x 240 is the launch's 384 x 168). cp.async writes through the generic proxy and
    wgmma reads through the async one, hence a proxy fence after each full wait. The output is staged in the query
    tile (each warpgroup reads only its own rows of it, and TileLang's consumer-only barrier orders the rest), not
    in a buffer that could alias a stage the other warpgroup still reads."""
    tokens, batch, blocks, max_blocks = (T.dynamic(name) for name in ("M", "B", "NB", "MAXB"))
    group = HEADS // KV_HEADS
    alloc_tiles = _overlap_tiles(BLOCK_M, BLOCK_N, HD, THREADS)
    gather, attend = _overlap_roles(BLOCK_M, BLOCK_N, HD, CACHE_BLOCK, SCALE, THREADS)

    @T.prim_func
    def attention_ws(Q: T.Tensor((tokens, HEADS, HD), BF16),
                     KC: T.Tensor((blocks, CACHE_BLOCK, KV_HEADS, HD), BF16),
                     VC: T.Tensor((blocks, CACHE_BLOCK, KV_HEADS, HD), BF16),
                     TABLES: T.Tensor((batch, max_blocks), T.int32), STARTS: T.Tensor((batch,), T.int32),
                     Q_LENS: T.Tensor((batch,), T.int32), CTX_LENS: T.Tensor((batch,), T.int32),
                     O: T.Tensor((tokens, HEADS, HD), BF16)):
        with T.Kernel(T.ceildiv(tokens, BLOCK_M), HEADS, batch, threads=THREADS + 128) as (bx, head, seq):
            b = alloc_tiles()
            kv_head = head // group
            tile = T.ceildiv(tokens, BLOCK_M) - 1 - bx  # the longest tiles (last queries) start first
            start = STARTS[seq]
            q_len = Q_LENS[seq]
            ctx = CTX_LENS[seq]
            q0 = tile * BLOCK_M
            first_pos = ctx - q_len + q0  # the position of the tile's first query
            kv_end = T.min(ctx, first_pos + BLOCK_M)
            last_page = (kv_end - 1) // CACHE_BLOCK
            n = T.ceildiv(kv_end, BLOCK_N)
            if q0 < q_len:
                if T.get_thread_binding() >= THREADS:
                    gather(KC, VC, b, TABLES, seq, kv_head, last_page, n)
                else:
                    attend(Q, O, b, start, q0, q_len, head, first_pos, kv_end, n)

    return attention_ws
