"""TileLang GEMM tiles at shapes and tiles of our choosing, against cuBLAS: the search behind the plan's tiles
(scripts/gpu/kernels.py times only what the plan compiled, at the model's own shapes; this times the product's
templates at any N, K and tile, e.g. the plain GEMM of gate/up's whole 2N rows beside the SiLU x up tile).

Here, with no GPU: `python lab/gemm_probe.py prepare --out .gpu/probe [--only LABEL...] [--decode]` compiles each
case of CASES to an sm_90a cubin with its launch record (index.json).
On the H200: `python3 lab/gemm_probe.py run --dir .gpu/probe --out $OUT` checks each case against torch and times
it at every M of PREFILL_M (a CUDA graph of repeats, best of ROUNDS alternated with cuBLAS's plain GEMM of the same
[M, rows of W, K] through torch), printing TFLOP/s and the share of cuBLAS ($OUT/probe.json). Decode cases (the
plan's four decode forms, backends/tilelang/kernels/decode_*.py, and gemm.py's 16-row tile, at the 4B model's decode
GEMMs) are timed at 1, 4 and 16 rows as a chain of launches over weight copies past the L2, plainly and
programmatically, in TB/s and as a share of the copy bandwidth measured in the same run ($OUT/decode_probe.json); a
paired case ("... after norm") is timed with rows.py's norm launch before it, which writes its rows.
"""

import argparse
import json
import multiprocessing
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pegainfer.backends.tilelang.plan import (HALVED, NARROW_CHAINED, NORMED_SILU, NORMED_SINGLE, PLANES_TILES,
                                              SHORT_PRE, SILU_16X16, WIDE_CHAINED, DecodeTile)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "gpu"))  # kernel_runs.py
SM = 90
PREFILL_M = (1024, 4096, 8192)
ROUNDS = 3
HOPPER = dict(BLOCK_K=64, THREADS=256, SWIZZLE=10, STAGES=4, FULL_ROW=True)
EPS = 1e-6
DECODE_ROWS = (1, 4, 16)
# the 4B model's decode GEMMs: (name, N, K, ACT)
DECODE_SHAPES = (("qkv", 6144, 2560, 0), ("o_proj", 2560, 4096, 0), ("gate_up", 9728, 2560, 1),
                 ("down", 2560, 9728, 0))
SHAPES = {name: (n, k, act) for name, n, k, act in DECODE_SHAPES}
# a decode form's threads beyond its consumers: the producer warpgroup, and decode_normed.py's scalers
WARPGROUPS = {"decode_tile": 1, "decode_halved": 1, "decode_planes": 1, "decode_normed": 2}


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


def tile_label(tile: DecodeTile, split: int = 1) -> str:
    return (f"{tile.block_n}x{tile.block_k} s{tile.stages} b{tile.min_blocks}" + (f" split{split}" if split > 1 else "")
            + (f" c{tile.chains}" if tile.chains > 1 else "") + (f" p{tile.pre}" if tile.pre else ""))


def decode_case(name: str, form: str, tile: DecodeTile, split: int = 1) -> Case:
    """A case of one of the plan's decode forms at the named GEMM's shape, launched programmatically; or, for form
    "gemm", gemm.py's 16-row tile with rows by cp.async (a tuning candidate of the plan, no PDL)."""
    n, k, act = SHAPES[name]
    tile = tile.filled(act)
    label = f"{name} {form.removeprefix('decode_')} {tile_label(tile, split)}"
    if form == "gemm":
        return Case(label, n, k, act, dict(tile.shape(), BLOCK_M=16, SWIZZLE=0, ASYNC_ROWS=True), decode=True)
    constexprs = tile.constexprs() | dict(PDL=True)
    if form == "decode_normed":
        constexprs |= dict(ADD=True, WRITE_SUM=True, EPS=EPS)
    if form == "decode_planes":
        constexprs |= dict(SPLIT=split)
    return Case(label, n, k, act, constexprs, form, f"{form}.py", decode=True)


def neighbours(tile: DecodeTile, **choices) -> list[DecodeTile]:
    """The tile, then the tile with each field given set to each of its values."""
    return [tile] + [replace(tile, **{field: value}) for field, values in choices.items() for value in values]


CASES = (
    Case("plain_128x256 N19456", 19456, 2560, 0, dict(BLOCK_M=128, BLOCK_N=256, **HOPPER)),
    Case("plain_256x128 N19456", 19456, 2560, 0, dict(BLOCK_M=256, BLOCK_N=128, **HOPPER)),
    Case("plain_128x128 N19456", 19456, 2560, 0, dict(BLOCK_M=128, BLOCK_N=128, **HOPPER)),
    Case("plain_128x256 N6144", 6144, 2560, 0, dict(BLOCK_M=128, BLOCK_N=256, **HOPPER)),
    Case("silu_merged_128x256", 9728, 2560, 1, dict(BLOCK_M=128, BLOCK_N=128, MERGED=True, **HOPPER)),
    Case("silu_128x128_rows", 9728, 2560, 1, dict(BLOCK_M=128, BLOCK_N=128, **HOPPER)),
    # gemm.py's 16x32 tile of o_proj and down, the anchor of the decode cases after it
    *[decode_case(name, "gemm", DecodeTile(32, 256, 4, 128, 2)) for name in ("o_proj", "down")],
    # decode_tile.py: the plan's tiles and their neighbours
    *[decode_case(name, "decode_tile", t) for name in ("qkv", "o_proj", "down")
      for base in (NARROW_CHAINED, WIDE_CHAINED)
      for t in neighbours(base, stages=(base.stages - 1, base.stages + 1), chains=(1, 2, 4), pre=(0, 1, 3))],
    *[decode_case("gate_up", "decode_tile", t) for t in neighbours(replace(SILU_16X16, stages=3), stages=(2, 4),
                                                                   min_blocks=(2,), pre=(1, 2))],
    # decode_normed.py: the norm in the tile, at QKV's and gate/up's shapes
    *[decode_case("qkv", "decode_normed", t) for t in neighbours(NORMED_SINGLE, stages=(4, 6, 8), pre=(0, 1, 3),
                                                                 chains=(1, 4))],
    *[decode_case("gate_up", "decode_normed", t) for t in neighbours(NORMED_SILU, stages=(4,), pre=(0, 2),
                                                                     min_blocks=(2,))],
    # decode_halved.py: 8 weight rows a CTA over both K halves
    *[decode_case(name, "decode_halved", t) for name in ("qkv", "o_proj", "down")
      for t in neighbours(HALVED, stages=(4, 5), pre=(2, 3, SHORT_PRE), chains=(2,), block_k=(128,))],
    # decode_planes.py: K split into fp32 planes the next kernel adds
    *[decode_case(name, "decode_planes", t, split) for name in ("o_proj", "down")
      for base in PLANES_TILES for t in neighbours(base, block_n=(16, 64), pre=(0, 2)) for split in (2, 4)
      if SHAPES[name][1] % (t.block_k * split) == 0],
)
CASES = tuple({c.label: c for c in CASES}.values())  # a neighbour may repeat its base

# QKV's 16-row candidates alone and after the norm launch that adds down's planes (the slot's hop), and that launch
NORM_LAUNCH = Case("norm launch K2560 planes", 2560, 2560, 0, dict(EPS=EPS, ADD=True, WRITE_SUM=True, THREADS=128,
                   PDL=True, PLANES=4), "add_rms_norm", "rows.py", decode=True)
PAIRED_BASES = tuple(c.label for c in CASES if c.label.startswith("qkv tile 16x256 s4 b3 c2"))
CASES += (NORM_LAUNCH,) + tuple(replace(c, label=c.label + " after norm", paired=True) for c in CASES
                                if c.label in PAIRED_BASES)


def launch_spec(case: Case):
    from pegainfer.backends.spec import GridDim, LaunchSpec, Param
    from pegainfer.backends.tilelang.launches import KERNELS

    source = (KERNELS / case.template).read_text()
    tensor = lambda name, dtype="*bf16": Param(name, "tensor", name.lower(), dtype, aligned=True)  # noqa: E731
    dim = Param("M", "int", "dim:tokens", "i32")
    if case.function == "add_rms_norm":  # the paired cases' norm launch: X + X2's planes, normed into A
        names = dict(X="x", X2="x2", G="g", S="s", Y="a")
        params = [Param(name, "tensor", value, "*bf16", aligned=True) for name, value in names.items()] + [
            dim, Param("P", "tensor", "xp", "*fp32", aligned=True), Param("PR", "int", "rows:xp", "i32")]
        return LaunchSpec(case.function, case.template, source, params, dict(K=case.k, **case.tile),
                          (GridDim(("tokens",)), GridDim((1,)), GridDim((1,))), 4, 1, backend="tilelang")
    params = [tensor("A"), tensor("W"), tensor("C"), dim]
    constexprs = dict(N=case.n, K=case.k, **case.tile)
    if case.function in ("decode_tile", "decode_normed", "gemm"):
        constexprs["ACT"] = case.act
    if case.function == "gemm":
        constexprs["RESIDUAL"] = False
    if case.function == "decode_normed":
        params = [tensor(name) for name in ("A", "X2", "G", "S", "W", "C")] + [dim]
    if case.function == "decode_planes":  # its planes are its output
        params = [tensor("A"), tensor("W"), tensor("P", "*fp32"), dim]
    # a normed or halved CTA covers 4 rows (its 8-row stage holds their pairs), a halved one BLOCK_N / 2 columns
    paired = case.function in ("decode_normed", "decode_halved")
    rows = case.tile.get("BLOCK_M", 4 if paired else 16)
    columns = case.tile["BLOCK_N"] // (2 if case.function == "decode_halved" else 1)
    grid = (GridDim((case.n,), columns), GridDim(("tokens",), rows), GridDim((case.tile.get("SPLIT", 1),)))
    threads = case.tile["THREADS"] + 128 * WARPGROUPS.get(case.function, 0)
    return LaunchSpec(case.function, case.template, source, params, constexprs, grid, threads // 32,
                      case.tile["STAGES"], backend="tilelang")


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
    from kernel_runs import Runner, rel_error, torch_time_us  # noqa: E402  (scripts/gpu/)

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
    from kernel_runs import L2_DEFEAT_BYTES, Runner, copy_bandwidth, rel_error  # noqa: E402

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
            prologue = norm_prologue(a) if case["function"] == "decode_normed" else {}
            if case.get("paired"):
                prologue = planes_prologue(a)
            y = (prologue.pop("operand") if prologue else a.float()) @ copies[0].float().T
            ref = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if act else y
            row = {"case": case["label"], "rows": rows, "n": w_rows, "k": k}
            try:
                # a planes case's output, NaN until written
                scratch = {"p": torch.full((16 * case["tile"].get("SPLIT", 1), n), float("nan"), device="cuda")}
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
    """What the case computed: C, or a planes case's planes ([SPLIT x 16, N] fp32) added in plane order, as the
    kernel after it would add them."""
    if case["function"] != "decode_planes":
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
    from kernel_runs import rms_normed  # noqa: E402  (scripts/gpu/)

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
    from kernel_runs import PowerSampler, Runner, torch_graph  # noqa: E402

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
