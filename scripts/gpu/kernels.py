"""On the H200: every TileLang and CuTe DSL kernel of Qwen3-4B, every TileLang variant of each slot (the tiles
`pegainfer tune` chooses among), loaded from the cubin cache through the runtime's launch path
(runtime/gpu/launch.py: TMA descriptors, CuTe tensor structs), checked against a torch reference, then timed:
prefill GEMMs (M = 1024, 4096, 8192) against cuBLAS through torch (each the best of ROUNDS timings alternated with
cuBLAS's), decode GEMVs (1, 4, 16 rows) against the measured copy bandwidth and cuBLAS, causal attention of one 8k
prompt in TFLOP/s of useful work; Triton's variant of the same slot beside each (at decode rows, every variant of
the slot, of any backend, timed with its norm launch). Timings replay a CUDA graph of the repeats, so packing the
arguments in Python (TMA descriptors encoded per launch) never starves the GPU; a GEMM's TFLOP/s counts its GEMM
launch alone (a norm prologue launch is timed apart, as `prologue_us`), which is what cuBLAS's number covers. A
decode variant's deferred launch (a split GEMM's sum, which the norm launch after it adds itself) is checked with it
but timed apart (`deferred_us`); a norm launch that can add such planes is also checked given them. A
failing case is recorded and the rest still run. Prints a table last; every number goes to $OUT/kernels.json.

    PEGAINFER_CACHE=.gpu/aot_cache python3 scripts/gpu/kernels.py --out $OUT
"""

import argparse
import json
import os
import traceback
from pathlib import Path

import torch

from pegainfer.backends import manifest as manifests
from pegainfer.backends.cache import cache_root, manifest_path
from pegainfer.backends.manifest import Kernel, Variant
from pegainfer.backends.planning import gemm_roles
from pegainfer.backends.spec import ParamKind, planes_of
from pegainfer.frontends.load import embedded_configs, load_spec
from pegainfer.ir.graph import KERNEL
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.gpu.kernel_bench import step_launches, synthetic_step

from kernel_runs import (L2_DEFEAT_BYTES, PowerSampler, Runner, copy_bandwidth, rel_error,  # beside this file
                         rms_normed, torch_graph, torch_graph_time_us, torch_time_us)

SM = 90
GEMM_KINDS = ("add_rms_norm_linear", "linear", "add_rms_norm_linear_silu_mul")
PREFILL_M = (1024, 4096, 8192)
DECODE_ROWS = (1, 4, 16)
ROUNDS = 3  # prefill GEMMs: each timed this many times alternated with cuBLAS, best of each (the clock drifts)
TORCH_DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "i64": torch.int64}


def variant(kernel: Kernel, label: str) -> Variant:
    return next(v for v in kernel.candidates if v.label == label)


def triton_for(kernel: Kernel, rows: int) -> Variant:
    return next(v for v in kernel.candidates if v.backend == "triton" and not v.min_sizes
                and (v.max_rows is None or rows <= v.max_rows))


def slot_variants(kernel: Kernel, rows: int) -> list[Variant]:
    """Every variant, of any backend, of the row-bounded slot serving `rows` rows (what `pegainfer tune` chooses
    among), taken from that slot: one label may name a variant of several slots."""
    bound = min(v.max_rows for v in kernel.candidates
                if v.max_rows is not None and not v.min_sizes and rows <= v.max_rows)
    return [v for v in kernel.candidates if not v.min_sizes and v.max_rows == bound]


def scratch_tensors(kernel: Kernel, sizes: dict[str, int], fill=torch.zeros) -> dict[str, torch.Tensor]:
    """Every candidate's scratch at these step sizes (zeros by default: split-K tickets start at zero)."""
    return {name: fill(tuple(sizes.get(d, d) for d in t.shape), dtype=TORCH_DTYPES[t.dtype.name], device="cuda")
            for name, t in kernel.candidate_scratch.items()}


def gemm_env(kernel: Kernel, roles: dict, rows: int, x, x2, g, w) -> tuple[dict, dict]:
    """A GEMM kernel's tensors (output, residual sum and scratch zeroed) and step sizes at `rows` rows."""
    sizes = {"tokens": rows, "samples": rows, "batch": rows}
    env = {roles["x"]: x, roles["weight"]: w, roles["out"]: torch.zeros(rows, roles["n"], device="cuda",
                                                                         dtype=torch.bfloat16)}
    env |= scratch_tensors(kernel, sizes)
    if roles["x2"]:
        env[roles["x2"]] = x2
        env[planes_of(roles["x2"])] = torch.zeros(0, x2.shape[1], device="cuda")  # X2 as stored (see planes_case)
    if roles["norm"]:
        env[roles["norm"]] = g
    if roles["sum"]:
        env[roles["sum"]] = torch.zeros_like(x)
    return env, sizes


def sustained_case(runner: Runner, kernel: Kernel, roles: dict, k: int, m: int, variants: list[Variant],
                   seconds: float, power: "PowerSampler") -> list[dict]:
    """Each variant's GEMM launch and cuBLAS's GEMM of the same shape, replayed back to back for `seconds` each,
    with the SM clock and board power of the window: a long prefill runs at the H200's 700 W cap, where the clock
    follows each kernel's power draw, and a 20-run burst catches the clock in its descent from 1980 MHz."""
    w_rows = 2 * roles["n"] if roles["act"] else roles["n"]
    x, x2 = (torch.randn(m, k, device="cuda").to(torch.bfloat16) for _ in range(2))
    g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(w_rows, k, device="cuda") * k ** -0.5).to(torch.bfloat16)
    flops = 2 * m * w_rows * k
    results = []
    for chosen in variants:
        env, sizes = gemm_env(kernel, roles, m, x, x2, g, w)
        runner.run(chosen.launches, env, sizes)  # the norm prologue fills the GEMM's operand
        replay = runner.replayer(chosen.launches[-1:], env, sizes)
        results.append({"kernel": kernel.node, "variant": chosen.label, "rows": m}
                       | power.measure(replay, runner.sync, seconds, 20 * flops))
    graph = torch_graph([lambda: x @ w.T])
    results.append({"kernel": kernel.node, "variant": "cublas (torch)", "rows": m}
                   | power.measure(graph.replay, torch.cuda.synchronize, seconds, 20 * flops))
    return results


def gemm_case(runner: Runner, kernel: Kernel, roles: dict, k: int, rows: int, variants: list[Variant], timing: str):
    """Numerics of each variant at `rows` rows against torch, then timings (and cuBLAS for prefill)."""
    n, act = roles["n"], roles["act"]
    w_rows = 2 * n if act else n
    gen = torch.Generator(device="cuda").manual_seed(rows)
    bf = torch.bfloat16
    x = torch.randn(rows, k, device="cuda", generator=gen).to(bf)
    x2 = torch.randn(rows, k, device="cuda", generator=gen).to(bf)
    g = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(bf)
    w = (torch.randn(w_rows, k, device="cuda", generator=gen) * k ** -0.5).to(bf)
    a = (x.float() + (x2.float() if roles["x2"] else 0)).to(bf)  # the residual stream is bf16
    a_bf = rms_normed(a, g, roles["eps"]) if roles["norm"] else a
    y = a_bf.float() @ w.float().T
    ref = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if act else y
    sum_ref = (x.float() + x2.float()).to(bf)
    # a decode GEMM streams its weight from memory: cycle through copies past the L2's 50 MB, as in serving
    copies = [w] + [w.clone() for _ in range(L2_DEFEAT_BYTES // (w.numel() * 2))] if timing == "decode" else []
    results, cublas_us = [], []
    for chosen in variants:
        env, sizes = gemm_env(kernel, roles, rows, x, x2, g, w)
        out, total = env[roles["out"]], env.get(roles["sum"])
        row = {"kernel": kernel.node, "variant": chosen.label, "rows": rows, "n": w_rows, "k": k}
        try:
            torch.cuda.synchronize()
            runner.run(chosen.launches, env, sizes)  # a deferred sum too: it writes the output checked
            runner.sync()
            row["rel_err"] = rel_error(out, ref)
            if roles["sum"]:
                row["sum_rel_err"] = rel_error(total, sum_ref)
            if rows <= 16 and roles["x2"] and any(p.kind is ParamKind.PLANES and p.value == roles["x2"]
                                                  for p in chosen.launches[0].params):  # a plane holds 16 rows
                row |= planes_case(runner, chosen, env, sizes, roles, x2, ref, sum_ref)
            timed = env if timing == "prefill" else [env | {roles["weight"]: copy} for copy in copies]
            launches = step_launches(chosen)  # what a step runs where the next kernel adds a split GEMM's planes
            row["us"] = runner.time_us(launches, timed, sizes)
            if len(launches) < len(chosen.launches):
                row["deferred_us"] = runner.time_us(chosen.launches[len(launches):], timed, sizes)
            if len(launches) > 1:
                row["prologue_us"] = runner.time_us(launches[:-1], timed, sizes)
            if timing == "prefill":  # the GEMM launch, best of ROUNDS alternated with cuBLAS's
                gemm_us = []
                for _ in range(ROUNDS):
                    gemm_us.append(runner.time_us(chosen.launches[-1:], timed, sizes))
                    cublas_us.append(torch_time_us(lambda: a_bf @ w.T))
                row["gemm_us"] = min(gemm_us)
                row["tflops"] = 2 * rows * w_rows * k / row["gemm_us"] / 1e6
            else:
                if len(launches) > 1:
                    row["gemm_us"] = runner.time_us(launches[-1:], timed, sizes)
                row["tb_per_s"] = w.numel() * 2 / row["us"] / 1e6
        except Exception as error:  # keep going: one broken kernel must not hide the others' numbers
            row["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        results.append(row)
    if timing == "prefill":
        us = min(cublas_us or [torch_time_us(lambda: a_bf @ w.T)])
        results.append({"kernel": kernel.node, "variant": "cublas (torch)", "rows": rows, "n": w_rows, "k": k,
                        "us": us, "tflops": 2 * rows * w_rows * k / us / 1e6})
    else:  # the same weight stream through cuBLAS (the plain GEMM on normed rows: no norm, no SiLU), as an anchor
        us = torch_graph_time_us([lambda copy=copy: a_bf @ copy.T for copy in copies])
        results.append({"kernel": kernel.node, "variant": "cublas (torch)", "rows": rows, "n": w_rows, "k": k,
                        "us": us, "tb_per_s": w.numel() * 2 / us / 1e6})
    return results


def planes_case(runner: Runner, chosen: Variant, env: dict, sizes: dict, roles: dict, x2, ref, sum_ref) -> dict:
    """A norm launch that can add a split GEMM's planes of X2, given X2 as four planes of a quarter of it each (a
    sum exact in fp32) and X2's own buffer zeroed: its output and residual sum must be those of X2 as stored."""
    planes = torch.zeros(64, x2.shape[1], device="cuda")  # a plane holds 16 rows, whatever the step's
    for s in range(4):
        planes[16 * s:16 * s + x2.shape[0]] = x2.float() / 4
    trial = env | {roles["x2"]: torch.zeros_like(x2), planes_of(roles["x2"]): planes}
    trial[roles["out"]] = torch.zeros_like(env[roles["out"]])
    if roles["sum"]:
        trial[roles["sum"]] = torch.zeros_like(env[roles["sum"]])
    runner.run(chosen.launches, trial, sizes)
    runner.sync()
    row = {"planes_rel_err": rel_error(trial[roles["out"]], ref)}
    if roles["sum"]:
        row["planes_sum_rel_err"] = rel_error(trial[roles["sum"]], sum_ref)
    return row


def attention_reference(q, k_cache, v_cache, step, scale):
    out = torch.zeros_like(q)
    block = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for b in range(len(step["seq_starts"])):
        start, q_len, ctx = (int(step[name][b]) for name in ("seq_starts", "query_lens", "context_lens"))
        blocks = torch.as_tensor(step["block_tables"][b, : -(-ctx // block)], device="cuda", dtype=torch.long)
        keys = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:ctx].repeat_interleave(group, 1)
        values = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:ctx].repeat_interleave(group, 1)
        mask = torch.arange(ctx, device="cuda")[None, :] <= torch.arange(ctx - q_len, ctx, device="cuda")[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start:start + q_len].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale)
        out[start:start + q_len] = o.transpose(0, 1)
    return out


def attention_case(runner: Runner, kernel: Kernel, node, types: dict, batch: int, q_len: int, ctx: int,
                   labels: list[str], check: bool) -> list[dict]:
    (inner,) = node.attrs["nodes"]
    q_name, k_name, v_name = inner.inputs[:3]
    heads, head_dim = inner.output_types[0].shape[1:]
    kv_heads = types[k_name].shape[2]
    step, sizes = synthetic_step(batch, q_len, ctx, runner.manifest.block_size)
    gen = torch.Generator(device="cuda").manual_seed(q_len)
    bf = torch.bfloat16
    q = torch.randn(sizes["tokens"], heads, head_dim, device="cuda", generator=gen).to(bf)
    cache_shape = (sizes["num_blocks"], sizes["block_size"], kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device="cuda", generator=gen).to(bf)
    v_cache = torch.randn(cache_shape, device="cuda", generator=gen).to(bf)
    env = {q_name: q, k_name: k_cache, v_name: v_cache}
    for name in ("block_tables", "seq_starts", "query_lens", "context_lens"):
        env[name] = torch.as_tensor(step[name], device="cuda")
    ref = attention_reference(q, k_cache, v_cache, step, inner.attrs["scale"]) if check else None
    visible = sum(ctx - q_len + i + 1 for i in range(q_len)) * batch
    results = []
    for label in labels:
        chosen = variant(kernel, label)
        out = torch.zeros_like(q)
        scratch = scratch_tensors(kernel, sizes, torch.empty)
        row = {"kernel": "attention", "variant": label, "batch": batch, "query_len": q_len, "context": ctx}
        try:
            run_env = env | scratch | {inner.outputs[0]: out}
            torch.cuda.synchronize()
            runner.run(chosen.launches, run_env, sizes)
            runner.sync()
            if check:
                row["rel_err"] = rel_error(out, ref)
            row["us"] = runner.time_us(chosen.launches, run_env, sizes, repeats=10)
            row["tflops"] = 4 * heads * head_dim * visible / row["us"] / 1e6
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        results.append(row)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--nodes", nargs="*", help="only these kernel nodes (o_proj, attention...): default all")
    parser.add_argument("--pdl", action="store_true",
                        help="programmatic dependent launch for the kernels compiled for it (as the runtime launches "
                             "steps of up to 16 tokens): back-to-back runs then overlap as a decode step's kernels do")
    parser.add_argument("--decode-only", action="store_true", help="GEMMs at decode row counts only (no prefill M)")
    parser.add_argument("--sustain", type=float, default=0.0, metavar="SECONDS",
                        help="also time each prefill GEMM's TileLang variants and cuBLAS replayed back to back for "
                             "SECONDS each, with the SM clock and board power (the regime of a long prefill)")
    args = parser.parse_args()
    if args.sustain < 0:
        parser.error(f"--sustain: seconds must not be negative, got {args.sustain}")
    args.out.mkdir(parents=True, exist_ok=True)
    spec = load_spec(embedded_configs()["qwen3-4b"])
    lowered, _ = lower(spec.graph)
    known = {n.name for g in lowered.all_graphs() for n in g.nodes if n.op == KERNEL}
    if set(args.nodes or ()) - known:
        parser.error(f"--nodes: no kernel named {sorted(set(args.nodes) - known)}; the kernels: {sorted(known)}")
    manifest = manifest_path(cache_root(), SM, spec)
    runner = Runner(manifest.parent.parent, manifests.load(manifest), args.pdl)
    report: dict = {"device": runner.ctx.name(), "copy_tb_per_s": copy_bandwidth() / 1e12, "gemm": [], "gemv": [],
                    "attention": [], "sustained": []}
    power = PowerSampler(args.out / "smi.csv") if args.sustain else None
    print(f"{report['device']}: copy {report['copy_tb_per_s']:.2f} TB/s", flush=True)
    for graph in lowered.all_graphs():
        for node in (n for n in graph.nodes if n.op == KERNEL and (not args.nodes or n.name in args.nodes)):
            kernel = runner.kernel(graph.name, node.name)
            labels = {v.label for v in kernel.candidates}
            if node.attrs["kind"] in GEMM_KINDS:
                roles = gemm_roles(node)
                k = graph.value_types()[roles["weight"]].shape[1]
                for m in PREFILL_M if not args.decode_only else ():
                    chosen = [variant(kernel, label) for label in sorted(labels) if label.startswith("tilelang:")]
                    chosen = [v for v in chosen if v.max_rows is None]  # the prefill tiles, not the decode ones
                    chosen.append(triton_for(kernel, m))
                    report["gemm"] += gemm_case(runner, kernel, roles, k, m, chosen, "prefill")
                    if args.sustain:
                        report["sustained"] += sustained_case(runner, kernel, roles, k, m, chosen[:-1], args.sustain,
                                                              power)
                for rows in DECODE_ROWS:
                    report["gemv"] += gemm_case(runner, kernel, roles, k, rows, slot_variants(kernel, rows), "decode")
            elif node.attrs["kind"] == "paged_attention":
                flash = [label for label in sorted(labels) if label.startswith("tilelang:")]
                for batch, q_len, ctx in ((2, 300, 700), (3, 130, 130)):  # the second: tiles of one and two key tiles
                    report["attention"] += attention_case(runner, kernel, node, graph.value_types(), batch, q_len,
                                                          ctx, flash + ["triton:flash_16"], True)
                report["attention"] += attention_case(runner, kernel, node, graph.value_types(), 1, 8192, 8192,
                                                      flash + ["triton:split_kv_16"], True)
            (args.out / "kernels.json").write_text(json.dumps(report, indent=1))
    copy = report["copy_tb_per_s"]
    cublas = {(r["kernel"], r["rows"]): r["tflops"] for r in report["gemm"] if r["variant"] == "cublas (torch)"}
    lines = [f"{'kernel':<14} {'variant':<30} {'shape':<22} {'rel err':>9} {'us':>9} {'metric':>22}"]
    for r in report["gemm"]:
        ratio = f" ({r['tflops'] / cublas[(r['kernel'], r['rows'])]:.0%} cuBLAS)" if "tflops" in r else ""
        norm = f" +{r['prologue_us']:.0f}us norm" if "prologue_us" in r else ""
        lines.append(_line(r, f"M{r['rows']} N{r['n']} K{r['k']}", f"{r.get('tflops', 0):.0f} TF/s{ratio}{norm}"))
    for r in report["gemv"]:
        metric = f"{r['tb_per_s']:.2f} TB/s ({r['tb_per_s'] / copy:.0%} copy)" if "tb_per_s" in r else ""
        metric += f" +{r['deferred_us']:.1f}us sum if not deferred" if "deferred_us" in r else ""
        metric += f" planes err {r['planes_rel_err']:.1e}" if "planes_rel_err" in r else ""
        lines.append(_line(r, f"rows{r['rows']} N{r['n']} K{r['k']}", metric))
    for r in report["attention"]:
        lines.append(_line(r, f"b{r['batch']} q{r['query_len']} ctx{r['context']}", f"{r.get('tflops', 0):.0f} TF/s"))
    cublas = {(r["kernel"], r["rows"]): r["sustained_tflops"] for r in report["sustained"]
              if r["variant"] == "cublas (torch)"}
    for r in report["sustained"]:
        share = r["sustained_tflops"] / cublas[(r["kernel"], r["rows"])]
        lines.append(f"{r['kernel']:<14} {r['variant']:<30} M{r['rows']:<5} sustained {r['sustained_tflops']:>4.0f} "
                     f"TF/s ({share:.0%} cuBLAS) at {r['mhz']:.0f} MHz, {r['watts']:.0f} W")
    print("\n".join(lines))
    if power:
        power.stop()
    (args.out / "kernels.json").write_text(json.dumps(report, indent=1))


def _line(r: dict, shape: str, metric: str) -> str:
    if "error" in r:
        return f"{r['kernel']:<14} {r['variant']:<30} {shape:<22} ERROR {r['error'][:60]}"
    err = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
    return f"{r['kernel']:<14} {r['variant']:<30} {shape:<22} {err:>9} {r['us']:>9.1f} {metric:>22}"


if __name__ == "__main__":
    main()
