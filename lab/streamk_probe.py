"""Persistent stream-K "swapped" decode GEMM in Triton (weights as the MMA's M operand) against cuBLAS, for 32-128 rows.

Every program streams an equal share of the (column tile, k-step) units, so each SM reads the same weight bytes once;
split tiles meet in the same launch (last arrival sums the partials in program order: replays are bit-identical).
Here, no GPU: `python lab/streamk_probe.py check` (interpreter, against float32 torch) and `... compile` (sm_90 PTX:
wgmma, registers, spills). On the GPU: `python3 lab/streamk_probe.py run --out $OUT [--rows 32 64 128] [--quick]`."""

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1" if sys.argv[1:2] == ["check"] else "0"  # read when the kernels are defined
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = {"qkv": (6144, 2560, 0), "o_proj": (2560, 4096, 0), "down": (2560, 9728, 0), "gate_up": (9728, 2560, 1)}
SMEM_LIMIT = 232448  # sm_90's largest dynamic shared memory a block (an SM has 233472, 1024 of it reserved a block)
L2_DEFEAT_BYTES = 400 << 20  # weight copies cycled through per timing (the L2 holds 50 MB)


@triton.jit
def _dot(w, x, acc, UPCAST: tl.constexpr):
    """acc + w @ x^T; UPCAST (the interpreter only: its bf16 dot is wrong in 3.6) multiplies in float32."""
    if UPCAST:
        acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


@triton.jit
def _store_out(acc, up, y_ptr, n0, M, N: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
               M_BLOCK: tl.constexpr):
    """The epilogue: bf16 (SiLU(gate) * up for ACT), stored transposed back to y [M, N]."""
    out = acc
    if ACT:
        out = acc / (1.0 + tl.exp(-acc)) * up
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_BLOCK)
    tl.store(y_ptr + offs_m[None, :] * N + offs_n[:, None], out.to(tl.bfloat16), mask=offs_m[None, :] < M)


@triton.jit
def _plane(part_ptr, slot, ACT: tl.constexpr, BLOCK_N: tl.constexpr, M_BLOCK: tl.constexpr):
    """Pointers to scratch slot `slot`'s gate (or only) plane [BLOCK_N, M_BLOCK]; the up plane follows it."""
    planes: tl.constexpr = 2 if ACT else 1
    offs = tl.arange(0, BLOCK_N)[:, None] * M_BLOCK + tl.arange(0, M_BLOCK)[None, :]
    return part_ptr + slot * (planes * BLOCK_N * M_BLOCK) + offs


@triton.jit
def streamk_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N: tl.constexpr, K: tl.constexpr,
                   ACT: tl.constexpr, P: tl.constexpr, SEGS: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, M_BLOCK: tl.constexpr, DIRECT: tl.constexpr, TMA: tl.constexpr,
                   UPCAST: tl.constexpr):
    """Program p streams units [p*U/P, (p+1)*U/P) of the U = tiles * k-steps units in one flat loop (pipelined by
    num_stages: no barrier or inner loop in it). A segment's end stores its float32 sums to slot (p, segment) (or,
    DIRECT, a tile it owns whole straight to y); the tickets are taken after the loop, and each tile's last
    arrival adds its partials in program order, runs the epilogue and zeroes the ticket for the next launch."""
    KSTEPS: tl.constexpr = K // BLOCK_K
    UNITS: tl.constexpr = (N // BLOCK_N) * KSTEPS
    pid = tl.program_id(0)
    start = pid * UNITS // P
    end = (pid + 1) * UNITS // P
    first_tile = start // KSTEPS
    if TMA:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2 * N if ACT else N, K], strides=[K, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[M_BLOCK, BLOCK_K])
    offs_m = tl.arange(0, M_BLOCK)
    acc = tl.zeros([BLOCK_N, M_BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, M_BLOCK], dtype=tl.float32)
    for u in tl.range(start, end):
        tile = u // KSTEPS
        ks = u - tile * KSTEPS
        n0 = tile * BLOCK_N
        k0 = ks * BLOCK_K
        if TMA:
            x = x_desc.load([0, k0])
            w = w_desc.load([n0, k0])
        else:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=offs_m[:, None] < M, other=0.0)
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])
        acc = _dot(w, x, acc, UPCAST)
        if ACT:
            if TMA:
                w_up = w_desc.load([N + n0, k0])
            else:
                w_up = tl.load(w_ptr + (N + offs_n[:, None]) * K + offs_k[None, :])
            up = _dot(w_up, x, up, UPCAST)
        if (ks == KSTEPS - 1) | (u == end - 1):
            whole = (ks == KSTEPS - 1) & (u - ks >= start)
            if DIRECT and whole:
                _store_out(acc, up, y_ptr, n0, M, N, ACT, BLOCK_N, M_BLOCK)
            else:
                part = _plane(part_ptr, pid * SEGS + tile - first_tile, ACT, BLOCK_N, M_BLOCK)
                tl.store(part, acc)
                if ACT:
                    tl.store(part + BLOCK_N * M_BLOCK, up)
            acc = tl.zeros([BLOCK_N, M_BLOCK], dtype=tl.float32)
            up = tl.zeros([BLOCK_N, M_BLOCK], dtype=tl.float32)
    tl.debug_barrier()  # every thread's partials are stored before the tickets (their release covers them)
    last_tile = tl.where(end > start, (end - 1) // KSTEPS + 1, first_tile)
    for tile in range(first_tile, last_tile):
        lo = tile * KSTEPS
        shared = (lo < start) | (lo + KSTEPS > end)
        if shared or not DIRECT:
            _meet(part_ptr, count_ptr, y_ptr, tile, M, N, ACT, P, SEGS, UNITS, KSTEPS, BLOCK_N, M_BLOCK)


@triton.jit
def _meet(part_ptr, count_ptr, y_ptr, tile, M, N: tl.constexpr, ACT: tl.constexpr, P: tl.constexpr,
          SEGS: tl.constexpr, UNITS: tl.constexpr, KSTEPS: tl.constexpr, BLOCK_N: tl.constexpr,
          M_BLOCK: tl.constexpr):
    """Takes tile's ticket; the last of its programs (p_first..p_last own its first and last unit) sums their
    slots in program order from L2 (.cg), zeroes the ticket and runs the epilogue."""
    p_first = ((tile * KSTEPS + 1) * P - 1) // UNITS
    p_last = ((tile + 1) * KSTEPS * P - 1) // UNITS
    if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == p_last - p_first:
        acc = tl.zeros([BLOCK_N, M_BLOCK], dtype=tl.float32)
        up = tl.zeros([BLOCK_N, M_BLOCK], dtype=tl.float32)
        for p in range(p_first, p_last + 1):
            part = _plane(part_ptr, p * SEGS + tile - (p * UNITS // P) // KSTEPS, ACT, BLOCK_N, M_BLOCK)
            acc += tl.load(part, cache_modifier=".cg")
            if ACT:
                up += tl.load(part + BLOCK_N * M_BLOCK, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + tile, 0)
        _store_out(acc, up, y_ptr, tile * BLOCK_N, M, N, ACT, BLOCK_N, M_BLOCK)


@dataclass(frozen=True)
class Config:
    bn: int
    bk: int
    stages: int
    warps: int
    p_mult: int  # programs = p_mult * SMs
    direct: int
    tma: int

    def name(self) -> str:
        return (f"{'tma' if self.tma else 'ptr'} n{self.bn} k{self.bk} s{self.stages} w{self.warps} "
                f"p{self.p_mult} d{self.direct}")


def pad_rows(m: int) -> int:
    """The row block: a power of two >= 16 (the MMA's N operand)."""
    return max(16, 1 << (m - 1).bit_length())


def estimate_shared(cfg: Config, m_block: int, act: int, stages: int) -> int:
    """Estimated shared memory: the pipeline's buffers and the epilogue's layout change (up to the fp32 tile)."""
    return stages * (cfg.bn * cfg.bk * (2 if act else 1) + m_block * cfg.bk) * 2 + cfg.bn * m_block * 4


def is_viable(cfg: Config, m: int, act: int) -> bool:
    """Fits shared memory (half of it at 2 programs an SM); accumulators of at most 128 registers a thread (more
    spill: see `compile`); 2 stages only where 3 do not fit."""
    m_block = pad_rows(m)
    if cfg.stages == 2 and estimate_shared(cfg, m_block, act, 3) <= SMEM_LIMIT:
        return False
    acc_regs = cfg.bn * m_block * (2 if act else 1) // (32 * cfg.warps)
    return estimate_shared(cfg, m_block, act, cfg.stages) <= SMEM_LIMIT // cfg.p_mult - 2048 and acc_regs <= 128


def list_configs(m: int, act: int, quick: bool) -> list[Config]:
    """The configs worth timing at M rows: every tile, depth, warps and programs that is viable (a few if quick),
    with direct stores; and direct stores off for two of them (the A/B)."""
    if quick:
        out = [Config(64, 128, 4, 4, 1, 1, 0), Config(64, 128, 4, 4, 1, 1, 1), Config(64, 64, 4, 4, 2, 1, 0),
               Config(64, 64, 3, 4, 1, 1, 1), Config(128, 64, 4, 8, 1, 1, 1), Config(128, 128, 3, 4, 1, 1, 1)]
    else:
        out = [Config(bn, bk, s, w, p, 1, tma) for bn in (64, 128) for bk in (64, 128) for s in (2, 3, 4, 6)
               for w in ((4, 8) if bn == 128 else (4,)) for p in (1, 2) for tma in (0, 1)]
    out += [Config(64, 64, 4, 4, 1, 0, 0), Config(64, 64, 4, 4, 1, 0, 1)]
    return [cfg for cfg in out if is_viable(cfg, m, act)]


def split_units(n: int, k: int, cfg: Config, programs: int) -> tuple[int, int]:
    """(units, SEGS): the most tiles one program's range touches, the scratch slots it needs."""
    ksteps = k // cfg.bk
    units = n // cfg.bn * ksteps
    segs = 1
    for p in range(programs):
        start, end = p * units // programs, (p + 1) * units // programs
        if end > start:
            segs = max(segs, (end - 1) // ksteps - start // ksteps + 1)
    return units, segs


def make_constexprs(n: int, k: int, act: int, m: int, cfg: Config, programs: int, upcast: bool) -> dict:
    """The kernel's constexprs; every program must own a unit (an empty one would hold up its tiles' tickets)."""
    units, segs = split_units(n, k, cfg, programs)
    assert n % cfg.bn == 0 and k % cfg.bk == 0 and programs <= units, (n, k, cfg, programs)
    return dict(N=n, K=k, ACT=act, P=programs, SEGS=segs, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, M_BLOCK=pad_rows(m),
                DIRECT=cfg.direct, TMA=cfg.tma, UPCAST=upcast)


class Launcher:
    """One config at one shape: its scratch and tickets (zeroed once: the kernel leaves them zero)."""

    def __init__(self, n: int, k: int, act: int, m: int, cfg: Config, programs: int, device: str,
                 upcast: bool = False) -> None:
        self.cfg, self.programs, self.m = cfg, programs, m
        self.meta = make_constexprs(n, k, act, m, cfg, programs, upcast)
        slots = programs * self.meta["SEGS"] * (2 if act else 1)
        self.part = torch.empty(slots * cfg.bn * self.meta["M_BLOCK"], dtype=torch.float32, device=device)
        self.count = torch.zeros(n // cfg.bn, dtype=torch.int32, device=device)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
        return streamk_kernel[(self.programs,)](x, w, y, self.part, self.count, self.m, **self.meta,
                                                num_warps=self.cfg.warps, num_stages=self.cfg.stages)


def compute_reference(x: torch.Tensor, w: torch.Tensor, act: int) -> torch.Tensor:
    out = x.float() @ w.float().T
    if act:
        gate, up = out.chunk(2, dim=1)
        out = torch.nn.functional.silu(gate) * up
    return out


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def check() -> None:
    """Interpreter runs at small shapes, P chosen so ranges cross tiles, split tiles and leave programs idle;
    each launched twice: bit-identical (the tickets were left zero)."""
    torch.manual_seed(0)
    n, k, m = 256, 512, 24
    cases = [(cfg, p, act) for act in (0, 1) for p in (3, 4, 7, 32) for cfg in
             (Config(64, 64, 3, 4, 1, 1, 0), Config(64, 64, 3, 4, 1, 0, 0), Config(128, 128, 3, 4, 1, 1, 1))]
    cases += [(Config(64, 128, 3, 4, 1, 0, 1), 5, 1), (Config(128, 64, 3, 4, 1, 1, 0), 9, 0),
              (Config(32, 256, 3, 4, 1, 1, 0), 3, 1), (Config(32, 256, 3, 4, 1, 0, 1), 3, 0)]  # 3 tiles a range
    for cfg, p, act in cases:
        p = min(p, split_units(n, k, cfg, p)[0])  # at most a unit a program
        x = torch.randn(m, k).to(torch.bfloat16)
        w = (torch.randn(n * (2 if act else 1), k) / k ** 0.5).to(torch.bfloat16)
        launch = Launcher(n, k, act, m, cfg, p, "cpu", upcast=True)
        y1, y2 = torch.full((m, n), float("nan"), dtype=torch.bfloat16), torch.full((m, n), 7.0, dtype=torch.bfloat16)
        launch(x, w, y1)
        launch(x, w, y2)
        ref = compute_reference(x, w, act)
        err = rel_error(y1, ref)
        assert err < 8e-3 and torch.equal(y1, y2) and not launch.count.any(), (cfg, p, act, err)
        print(f"OK {cfg.name()} P={p} act={act} segs={launch.meta['SEGS']} rel_err={err:.1e}")
    print("check OK")


def compile_one(job: tuple) -> dict:
    """sm_90 PTX and cubin of one config, read for wgmma, cp.async (is the loop pipelined?), registers, spills."""
    shape, m, cfg = job
    n, k, act = SHAPES[shape]
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    meta = make_constexprs(n, k, act, m, cfg, 132 * cfg.p_mult, False)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
             "M": "i32"}
    args = streamk_kernel.arg_names
    signature = {a: types.get(a, "constexpr") for a in args}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(args) if a.endswith("_ptr")}
    row = {"shape": shape, "m": m, "config": cfg.name()}
    try:
        compiled = triton.compile(ASTSource(streamk_kernel, signature=signature, constexprs=meta, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": cfg.warps, "num_stages": cfg.stages})
    except Exception as error:  # noqa: BLE001 - a config that fails is reported, never fatal
        return row | {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    ptx = compiled.asm["ptx"]
    row |= {"wgmma": ptx.count("wgmma.mma_async"), "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "tma": ptx.count("cp.async.bulk.tensor"), "shared": compiled.metadata.shared}
    return row | read_resources(compiled.asm["cubin"])


def read_resources(cubin: bytes) -> dict:
    """Registers and stack frame (spills) from cuobjdump -res-usage, shipped in triton's backend."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return {"regs": int(found.get("REG", -1)), "stack": int(found.get("STACK", -1))}


def compile_all(args) -> None:
    jobs = [(s, m, cfg) for s in args.shapes for m in args.rows for cfg in list_configs(m, SHAPES[s][2], args.quick)]
    print(f"{len(jobs)} compiles for sm_90")
    print(f"{'shape':8} {'M':>4} {'config':28} {'wgmma':>5} {'cp.async':>8} {'tma':>4} {'regs':>4} {'spill':>5} "
          f"{'smem':>7}")
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for row in pool.map(compile_one, jobs):
            if "error" in row:
                print(f"{row['shape']:8} {row['m']:4} {row['config']:28} ERROR {row['error']}")
                continue
            print(f"{row['shape']:8} {row['m']:4} {row['config']:28} {row['wgmma']:5} {row['cp_async']:8} "
                  f"{row['tma']:4} {row['regs']:4} {row['stack']:5} {row['shared']:7}")


def warm_up(job: tuple) -> str:
    """Compiles one (shape, M, config) for the GPU here (a worker), filling Triton's cache for the timing run."""
    shape, m, cfg = job
    n, k, act = SHAPES[shape]
    programs = torch.cuda.get_device_properties(0).multi_processor_count * cfg.p_mult
    try:
        streamk_kernel.warmup(*[torch.bfloat16] * 3, torch.float32, torch.int32, m, grid=(programs,),
                              **make_constexprs(n, k, act, m, cfg, programs, False), num_warps=cfg.warps,
                              num_stages=cfg.stages)
        return ""
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def time_graph(calls: list, passes: int = 2, rounds: int = 5) -> float:
    """Microseconds a call: median of `rounds` replays of a CUDA graph cycling `passes` times through `calls`."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(passes):
            for call in calls:
                call()
    graph.replay()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (passes * len(calls)))
    return sorted(times)[len(times) // 2]


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB bf16 device copy (4 GiB moved)."""
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    us = time_graph([lambda: b.copy_(a)], passes=5)
    return 4 * (1 << 30) / (us * 1e-6)


def time_case(shape: str, m: int, cfgs: list[Config], errors: dict, sms: int, copy: float) -> list[dict]:
    n, k, act = SHAPES[shape]
    w_bytes = n * (2 if act else 1) * k * 2
    copies = [(torch.randn(n * (2 if act else 1), k, device="cuda") / k ** 0.5).to(torch.bfloat16)
              for _ in range(max(2, -(-L2_DEFEAT_BYTES // w_bytes)))]
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    ref = compute_reference(x, copies[0], act)
    share = lambda us: w_bytes / (us * 1e-6) / copy  # noqa: E731
    rows = [{"shape": shape, "m": m, "config": "cublas", "us": time_graph([lambda w=w: x @ w.T for w in copies])}]
    for cfg in cfgs:
        if errors.get(cfg):
            print(f"{shape:8} {m:4} {cfg.name():28} ERROR compile: {errors[cfg]}")
            continue
        try:
            launch = Launcher(n, k, act, m, cfg, sms * cfg.p_mult, "cuda")
            y.fill_(float("nan"))  # a cell the kernel misses shows
            kernel = launch(x, copies[0], y)
            if cfg.p_mult > 1 and (kernel.metadata.shared > SMEM_LIMIT // 2 - 1024
                                   or 2 * cfg.warps * 32 * kernel.n_regs > 65536):
                print(f"{shape:8} {m:4} {cfg.name():28} skipped: 2 CTAs do not fit an SM ({kernel.n_regs} regs)")
                continue
            first = y.clone()
            launch(x, copies[0], y)  # again: bit-identical, the tickets left zero
            err = rel_error(first, ref)
            ok = err < 1e-2 and torch.equal(first, y) and not launch.count.any()
            us = time_graph([lambda w=w: launch(x, w, y) for w in copies])
            rows.append({"shape": shape, "m": m, "config": cfg.name(), "us": us, "rel_err": err, "ok": ok,
                         "regs": kernel.n_regs, "spills": kernel.n_spills, "shared": kernel.metadata.shared})
        except Exception as error:  # noqa: BLE001 - one failing config never aborts the run
            print(f"{shape:8} {m:4} {cfg.name():28} ERROR {type(error).__name__}: {str(error).splitlines()[0][:200]}")
            torch.cuda.synchronize()
    for r in rows:
        r |= {"tb_per_s": w_bytes / (r["us"] * 1e-6) / 1e12, "share": share(r["us"])}
        print(f"{shape:8} {m:4} {r['config']:28} {r['us']:8.2f} us {r['tb_per_s']:5.2f} TB/s {r['share']:6.1%}"
              + (f" err {r['rel_err']:.1e}{'' if r['ok'] else ' WRONG'} regs {r['regs']} spills {r['spills']}"
                 if "ok" in r else ""))
    return rows


def run(args) -> None:
    """Compiles every case in worker processes (one process compiles serially), then checks and times each."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    began = time.time()
    jobs = [(s, m, cfg) for s in args.shapes for m in args.rows for cfg in list_configs(m, SHAPES[s][2], args.quick)]
    try:
        with ProcessPoolExecutor(min(args.jobs, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
            errors = dict(zip(jobs, pool.map(warm_up, jobs, chunksize=2)))
    except Exception as error:  # noqa: BLE001 - then each config compiles when first launched
        print(f"parallel compile failed ({type(error).__name__}: {error}); compiling as the configs run")
        errors = {}
    print(f"{len(jobs)} compiles in {time.time() - began:.0f} s on {torch.cuda.get_device_name()}, {sms} SMs")
    copy = measure_copy_bandwidth()
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s; share = weight bytes / time / copy bandwidth")
    rows = []
    for s in args.shapes:
        for m in args.rows:
            cfgs = list_configs(m, SHAPES[s][2], args.quick)
            rows += time_case(s, m, cfgs, {c: errors.get((s, m, c)) for c in cfgs}, sms, copy)
            torch.cuda.empty_cache()
    (out / "streamk.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "sms": sms,
                                                  "copy_tb_per_s": copy / 1e12, "rows": rows}, indent=1))
    print(f"\nbest per shape and M ({time.time() - began:.0f} s in all)")
    for s in args.shapes:
        for m in args.rows:
            case = [r for r in rows if r["shape"] == s and r["m"] == m]
            cublas = next(r for r in case if r["config"] == "cublas")
            best = min((r for r in case if r.get("ok")), key=lambda r: r["us"], default=None)
            if best:
                print(f"{s:8} {m:4} {best['config']:28} {best['us']:8.2f} us {best['share']:6.1%} | cublas "
                      f"{cublas['us']:8.2f} us {cublas['share']:6.1%} | x{cublas['us'] / best['us']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check")
    for name in ("compile", "run"):
        p = sub.add_parser(name)
        p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128])
        p.add_argument("--shapes", nargs="+", default=list(SHAPES) if name == "run" else ["qkv", "gate_up"])
        p.add_argument("--quick", action="store_true")
        p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    sub.choices["run"].add_argument("--out", required=True)
    args = parser.parse_args()
    {"check": lambda a: check(), "compile": compile_all, "run": run}[args.command](args)


if __name__ == "__main__":
    main()
