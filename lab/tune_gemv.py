"""Tile search for the decode GEMMs of a model (the measurement behind backends/triton/plan.py's GEMV tiles).

Here, with no GPU: `python lab/tune_gemv.py prepare --out .gpu/tune [--rows 1 4 16] [--only PREFIX...]`
compiles, for every GEMM kernel of Qwen3-4B and each row count, the plan's own decode variants for it plus candidate
tiles (at 1 row, gemv_row_kernel's; at more, gemv_rows_kernel's, gemv_row_kernel's a row a program (the plan's
gemv_1 at 4 rows), and the tensor-core linear_kernel's and linear_split_kernel's) to sm_90 cubins.
On the GPU: `python lab/tune_gemv.py run --dir .gpu/tune --out $OUT` launches each candidate on random
bf16 data, checks its output against the plan's variant, and times it in a CUDA graph that cycles through enough
copies of the weight to defeat the L2, printing microseconds and TB/s per candidate (best first per shape); with
`--pdl`, each candidate compiled to wait for its predecessor is timed again launched programmatically, as the
runtime launches steps of up to 16 tokens (each run may start while the one before drains)."""

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

SM = 90
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension
L2_DEFEAT_BYTES = 256 << 20  # cycle through this many bytes of weight copies (the H200's L2 holds 50 MB)


def candidates(launch, act: bool, rows: int, split_launch=None) -> list[tuple[str, object]]:
    """(label, LaunchSpec) for each tile to try at this row count; `split_launch`, the plan's split variant, is
    the pattern of the split-K candidates."""
    n = launch.constexprs["N"]
    out = []
    row_tiles = [(1, 1024, 2), (2, 512, 2), (2, 1024, 2), (4, 256, 2), (1, 1024, 4), (2, 1024, 4), (4, 512, 4),
                 (4, 1024, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (1, 2048, 8), (2, 2048, 8), (4, 1024, 8)]
    for bn, bk, warps in row_tiles if rows == 1 else row_tiles[4:10]:  # at more rows, a program a row
        if bn * bk * (2 if act else 1) // (32 * warps) > 64 or -(-n // bn) > MAX_GRID_Y:
            continue
        out.append((f"gemv_1 n{bn} k{bk} w{warps}", _tile(launch, "gemv_row_kernel", 1, bn, bk, warps, 1)))
    if rows == 1:
        return out
    for warps in (2, 4, 8):  # K tiles of 256 a warp: every warp on K, so the products need no layout change
        for block_m in sorted({rows, max(1, rows // 2), max(1, rows // 4)}):
            for bn in (1, 2, 4):
                if block_m * bn * 8 * (2 if act else 1) > 128:  # accumulator registers a thread
                    continue
                out.append((f"rows m{block_m} n{bn} k{256 * warps} w{warps}",
                            _tile(launch, "gemv_rows_kernel", block_m, bn, 256 * warps, warps, 1)))
    for bn, warps in ((4, 4), (8, 4), (16, 4), (4, 8), (8, 8), (16, 8)) if rows <= 4 else ():
        if -(-n // bn) <= MAX_GRID_Y and rows * bn * (2 if act else 1) <= 64:
            vec = _tile(launch, "gemv_rows_kernel", rows, bn, 256 * warps, warps, 1)  # 8 K a thread
            out.append((f"vrows m{rows} n{bn} k{256 * warps} w{warps}",
                        replace(vec, constexprs=dict(vec.constexprs, VEC=8))))
    for bn, bk, warps, stages in ((16, 256, 4, 3), (16, 512, 4, 3), (16, 128, 4, 5), (32, 256, 4, 3),
                                  (16, 256, 2, 4), (16, 512, 8, 3), (32, 128, 4, 4)):
        out.append((f"mma m16 n{bn} k{bk} w{warps} s{stages}", _tile(launch, "linear_kernel", 16, bn, bk, warps,
                                                                     stages)))
    k = launch.constexprs["K"]
    for bn, bk, warps, stages in ((32, 256, 4, 3), (16, 256, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3)):
        for split in (2, 4, 8, 16):
            if split_launch is not None and 2 * split * bk <= k and not (act and bn == 64):
                out.append((f"split{split} m16 n{bn} k{bk} w{warps} s{stages}",
                            _split_tile(split_launch, bn, bk, warps, stages, split)))
    return out


def _split_tile(launch, bn: int, bk: int, warps: int, stages: int, split: int):
    tiled = _tile(launch, "linear_split_kernel", 16, bn, bk, warps, stages)
    grid = (*tiled.grid[:2], replace(tiled.grid[2], factors=(split,)))
    return replace(tiled, constexprs=dict(tiled.constexprs, SPLIT=split), grid=grid)


def _tile(launch, function: str, block_m: int, bn: int, bk: int, warps: int, stages: int):
    constexprs = dict(launch.constexprs, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk)
    if function in ("gemv_row_kernel", "gemv_rows_kernel"):
        constexprs["RMS_BLOCK"] = min(1 << (launch.constexprs["K"] - 1).bit_length(), 1024 * warps // block_m)
    else:
        constexprs.pop("RMS_BLOCK", None)
    if function == "gemv_rows_kernel":
        constexprs.setdefault("VEC", 1)
    else:
        constexprs.pop("VEC", None)
    grid = (replace(launch.grid[0], block=block_m), replace(launch.grid[1], block=bn), launch.grid[2])
    return replace(launch, function=function, constexprs=constexprs, grid=grid, num_warps=warps, num_stages=stages)


def _out_f32(launch) -> bool:
    return next(p.dtype for p in launch.params if p.name == "out_ptr") == "*fp32"


def _compile(item):
    from pegainfer.backends.triton.compiler import compile_launch

    key, launch = item
    try:
        compiled = compile_launch(launch, SM)
    except Exception as error:  # a tile that does not compile is reported, not fatal
        return key, None, f"{type(error).__name__}: {str(error)[:200]}"
    return key, compiled, None


def prepare(out: Path, row_counts: list[int], only: list[str] | None = None) -> None:
    from pegainfer.backends.build import plan_model
    from pegainfer.backends.triton.plan import PlanOptions
    from pegainfer.frontends.load import embedded_configs, load_spec

    spec = load_spec(embedded_configs()["qwen3-4b"])
    _, kernels = plan_model(spec, PlanOptions())
    todo, index = {}, []
    for kernel in kernels:
        variants = {v.name: v for v in kernel.variants}
        if "gemv_1" not in variants or len(variants["gemv_1"].launches) > 1:  # not the sampler's tail
            continue
        for rows in row_counts:
            plans = [v for v in kernel.variants if v.max_rows is None or rows <= v.max_rows]
            plans = [v for v in plans if v.max_rows == min(p.max_rows or 1 << 30 for p in plans)]
            base = variants["gemv_1"].launches[0]
            # one launch each: a variant with its norm as a launch of its own is timed by kernels.py instead (and
            # a GEMM with a norm has no split pattern here: its split variant runs the norm first)
            entries = [(f"plan {v.name}", v.launches[0]) for v in plans if len(v.launches) == 1]
            split = next((v.launches[0] for v in kernel.variants if v.launches[0].function == "linear_split_kernel"),
                         None)
            tiles = candidates(base, bool(base.constexprs["ACT"]), rows, split)
            tiles = [(label, t) for label, t in tiles if only is None or label.startswith(tuple(only))]
            for label, launch in entries + tiles:
                key = f"{kernel.node}.m{rows}.{len(todo)}"
                todo[key] = launch
                index.append(dict(key=key, kernel=kernel.node, rows=rows, label=label, function=launch.function,
                                  params=[p.name for p in launch.params], out_f32=_out_f32(launch),
                                  constexprs=launch.constexprs,
                                  grid=[[list(g.factors), g.block, g.times] for g in launch.grid]))
    out.mkdir(parents=True, exist_ok=True)
    failed = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=context) as pool:
        for key, compiled, error in pool.map(_compile, todo.items()):
            if compiled is None:
                failed[key] = error
                continue
            (out / f"{key}.cubin").write_bytes(compiled.cubin)
            entry = next(e for e in index if e["key"] == key)
            entry.update(symbol=compiled.function, shared=compiled.shared, warps=compiled.num_warps,
                         scratch=compiled.scratch, pdl=compiled.pdl)
    index = [e for e in index if e["key"] not in failed]
    (out / "index.json").write_text(json.dumps(index, indent=1))
    print(f"{len(index)} candidates compiled, {len(failed)} failed", *failed.items(), sep="\n")


def run(folder: Path, out: Path, pdl: bool = False) -> None:
    import ctypes

    import numpy as np

    from pegainfer.runtime.cuda import driver as cu
    from pegainfer.runtime.gpu.kernel_bench import graph_seconds
    from pegainfer.runtime.gpu.launch import load_function

    ctx = cu.Context.create(0)
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((folder / "index.json").read_text())
    rng = np.random.default_rng(0)
    results, buffers = [], {}
    for (kernel, rows), group in _groups(index).items():
        c = group[0]["constexprs"]
        n, k, act = c["N"], c["K"], c["ACT"]
        w_rows = n * (2 if act else 1)
        w_bytes = w_rows * k * 2
        copies = max(2, -(-L2_DEFEAT_BYTES // w_bytes))
        if kernel not in buffers:
            buffers[kernel] = [_upload(rng.standard_normal((w_rows, k), dtype=np.float32) * 0.02)
                               for _ in range(copies)]
        weights = buffers[kernel]
        x = _upload(rng.standard_normal((rows, k), dtype=np.float32))
        x2 = _upload(rng.standard_normal((rows, k), dtype=np.float32))
        norm = _upload(1 + 0.1 * rng.standard_normal(k, dtype=np.float32))
        ids = cu.alloc(4 * rows)
        cu.copy_to_device(ids, np.arange(rows, dtype=np.int32))
        summed = cu.alloc(rows * k * 2)
        part, count = _zeros(16 * w_rows * 4), _zeros(4 * (n // 16 + 1))  # a split GEMM's sums and tickets
        reference = None
        for entry in group:
            result = cu.alloc(rows * n * 4)
            _, function = load_function((folder / f"{entry['key']}.cubin").read_bytes(), entry)
            grid = tuple(-(-_size(f, rows) // b) * t for f, b, t in entry["grid"])
            values = dict(x_ptr=x, x2_ptr=x2, rows_ptr=ids, norm_ptr=norm, bias_ptr=0, out_ptr=result,
                          sum_ptr=summed, part_ptr=part, count_ptr=count, M=rows, stride_x=k, stride_x2=k,
                          stride_out=n, stride_sum=k)
            scratch = _scratch(entry, grid)
            packed = [_pack(entry["params"], values | {"w_ptr": w}, scratch) for w in weights]

            def launch(args, pdl: bool = False):
                cu.launch(function, entry["symbol"], grid, 32 * entry["warps"], entry["shared"], ctx.stream,
                          ctypes.addressof(args[1]), pdl=pdl)

            launch(packed[0])
            ctx.synchronize()
            got = _read(result, rows * n, entry["out_f32"])
            reference = got if reference is None else reference
            error = float(np.abs(got - reference).max() / (np.abs(reference).max() + 1e-9))
            seconds = graph_seconds(ctx, lambda: [launch(args) for args in packed]) / len(packed)
            row = dict(kernel=kernel, rows=rows, label=entry["label"], us=seconds * 1e6,
                       tbps=w_bytes / seconds / 1e12, rel_err=error, grid=grid)
            if pdl and entry.get("pdl"):  # as the runtime launches it: each may start as the last drains
                pdl_seconds = graph_seconds(ctx, lambda: [launch(args, True) for args in packed]) / len(packed)
                row.update(pdl_us=pdl_seconds * 1e6, pdl_tbps=w_bytes / pdl_seconds / 1e12)
            results.append(row)
            cu.free(result)
        (out / "tune_gemv.json").write_text(json.dumps(results, indent=1))
    _table(results)


def _groups(index: list[dict]) -> dict:
    groups: dict = {}
    for entry in index:
        groups.setdefault((entry["kernel"], entry["rows"]), []).append(entry)
    return groups


def _size(factors, rows: int) -> int:
    total = 1
    for f in factors:
        total *= f if isinstance(f, int) else rows
    return total


def _scratch(entry: dict, grid: tuple[int, int, int]) -> list[int]:
    """Triton's two trailing scratch pointers (global, profile): a buffer per program when the kernel asks."""
    from pegainfer.runtime.cuda import driver as cu

    programs = grid[0] * grid[1] * grid[2]
    sizes = entry["scratch"]
    return [cu.alloc(sizes[f"{name}_size"] * programs) if sizes[f"{name}_size"] else 0
            for name in ("global_scratch", "profile_scratch")]


def _pack(params: list[str], values: dict, scratch: list[int]):
    """ctypes storage of each argument in order, and the kernelParams array pointing at them."""
    import ctypes

    ints = ("M", "stride_x", "stride_x2", "stride_out", "stride_sum")
    args = [ctypes.c_int32(values[p]) if p in ints else ctypes.c_uint64(values[p]) for p in params]
    args += [ctypes.c_uint64(ptr) for ptr in scratch]
    return args, (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])


def _zeros(nbytes: int) -> int:
    import numpy as np

    from pegainfer.runtime.cuda import driver as cu

    ptr = cu.alloc(nbytes)
    cu.copy_to_device(ptr, np.zeros(nbytes, dtype=np.uint8))
    return ptr


def _upload(array) -> int:
    import ml_dtypes
    import numpy as np

    from pegainfer.runtime.cuda import driver as cu

    data = np.ascontiguousarray(array.astype(ml_dtypes.bfloat16))
    ptr = cu.alloc(data.nbytes)
    cu.copy_to_device(ptr, data)
    return ptr


def _read(ptr: int, count: int, f32: bool):
    import ml_dtypes
    import numpy as np

    from pegainfer.runtime.cuda import driver as cu

    host = np.empty(count, dtype=np.float32 if f32 else ml_dtypes.bfloat16)
    cu.copy_to_host(host, ptr)
    return host.astype(np.float32)


def _table(results: list[dict]) -> None:
    print(f"\n{'kernel':<14}{'rows':>5}  {'candidate':<26}{'us':>8}{'TB/s':>7}{'rel err':>10}{'pdl us':>8}{'TB/s':>7}")
    for (kernel, rows), group in _groups(results).items():
        plans = [r for r in group if r["label"].startswith("plan")]
        for r in sorted(group, key=lambda r: min(r["us"], r.get("pdl_us", r["us"])))[:6] + plans:
            pdl = f"{r['pdl_us']:>8.1f}{r['pdl_tbps']:>7.2f}" if "pdl_us" in r else ""
            print(f"{kernel:<14}{rows:>5}  {r['label']:<26}{r['us']:>8.1f}{r['tbps']:>7.2f}{r['rel_err']:>10.1e}{pdl}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("prepare", "run"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dir", type=Path, default=Path(".gpu/tune"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="row counts to search (prepare)")
    parser.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                        help="candidates whose label starts so, beside the plan's own (prepare)")
    parser.add_argument("--pdl", action="store_true",
                        help="time each candidate compiled for it with programmatic dependent launch too (run)")
    args = parser.parse_args(argv)
    prepare(args.out, args.rows, args.only) if args.mode == "prepare" else run(args.dir, args.out, args.pdl)


if __name__ == "__main__":
    main(sys.argv[1:])
