"""On the H200 (after scripts/gpu/prepare_w8a8.sh): the W8A8 GEMMs (rows.py `quantize_rows`, then gemm_fp8.py or
swapped_fp8.py) of FP8 weights in 128 x 128 blocks (qwen3-4b-fp8) and with a scale per output column (qwen3-4b
--quantization fp8). Sections: `small`, the small FP8 checkpoint's prefill of 2000 and 4000 rows against the CPU,
W8A8 and with Triton's W8A16 tiles; `decode`, Qwen3-4B decode steps of bf16 and both FP8 forms (W8A8, and Triton's
W8A16 tiles at the decode slots); `gemm`, each prefill GEMM at M = 1024 and 4096 checked against torch's emulation
of the same arithmetic (each row's 128-column groups over their largest magnitude / 448, rounded to e4m3, the
products summed in float32; the rows' quantization on its own too) and against the W8A16 product, timed beside
Triton's W8A16 tile and cuBLAS's bf16 GEMM; `prefill`, time to first token of bf16 and both FP8 forms, W8A8 and
with triton:dot_64 at any rows. Prints a table last; every number goes to $OUT/w8a8.json.
    carry [".gpu/cache_w8a8"]:
    PYTHONPATH=$PYTHONPATH:scripts/gpu PEGAINFER_CACHE=$PWD/.gpu/cache_w8a8 python3 scripts/gpu/w8a8_check.py --out $OUT
(source env.sh first)"""

import argparse
import json
import shutil
import traceback
from pathlib import Path

import torch
from kernel_runs import Runner, rel_error, rms_normed, torch_time_us  # beside this file

from pegainfer.backends import manifest as manifests
from pegainfer.backends.manifest import Kernel
from pegainfer.backends.planning import gemm_roles
from pegainfer.backends.select import reselect, slot_key, slots
from pegainfer.frontends.load import load_spec, resolve_config_path
from pegainfer.ir.graph import KERNEL
from pegainfer.passes.pipeline import lower
from pegainfer.runtime import bench
from pegainfer.runtime.gpu.start import ensure_manifest

SM = 90
ROWS = (1024, 4096)
PROMPTS = [1024, 4096]
W8A16 = "triton:dot_64"
TORCH = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "f8e4m3": torch.float8_e4m3fn}
DECODE_BATCHES = (1, 16, 64, 128)
DECODE_CONTEXTS = (128, 1024)
MODELS = (("bf16", "qwen3-4b", None), ("fp8_block", "qwen3-4b-fp8", None), ("fp8_channel", "qwen3-4b", "fp8"))


def quantize_groups(a: torch.Tensor) -> torch.Tensor:
    """The rows as W8A8 multiplies them: per row and 128 columns, e4m3(x / (max |x| / 448)) times that scale."""
    groups = a.float().view(a.shape[0], -1, 128)
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).view(a.shape)


def dequantized(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(min(block[1], w.shape[1]), 1)
    return w.float() * expanded[:w.shape[0], :w.shape[1]]


def quantized_rows_case(values: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor) -> dict:
    """quantize_rows' output against torch's quantization of the rows it should have quantized."""
    groups = rows.float().view(rows.shape[0], -1, 128)
    expected_scales = groups.abs().amax(-1).clamp_min(1e-10) / 448
    expected = (groups / expected_scales[..., None]).to(torch.float8_e4m3fn).view(rows.shape)
    same = values.view(torch.uint8) == expected.view(torch.uint8)
    return {"scales_rel_err": rel_error(scales, expected_scales), "values_differing": float(1 - same.float().mean()),
            "values_err": rel_error(values.float(), expected.float())}


def gemm_case(runner: Runner, kernel: Kernel, roles: dict, k: int, m: int) -> list[dict]:
    n, act = roles["n"], roles["act"]
    w_rows = 2 * n if act else n
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    x2 = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    g = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    w = (torch.randn(w_rows, k, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    block = roles["scale_block"]
    shape = (-(-w_rows // block[0]), -(-k // block[1]))
    scale = (0.5 + torch.rand(shape, device="cuda", generator=gen)) * k ** -0.5 / 64
    a = (x.float() + x2.float()).to(torch.bfloat16) if roles["x2"] else x
    a = rms_normed(a, g, roles["eps"]) if roles["norm"] else a
    # quantize_rows rounds the normed row to bf16 once (x * rsqrt * g in float32), Hugging Face's twice: a bf16 ulp
    # moves a group's scale, and with it every rounding of the group, so the emulation follows the kernel
    q = (x.float() + x2.float()).to(torch.bfloat16).float() if roles["x2"] else x.float()
    if roles["norm"]:
        q = (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + roles["eps"]) * g.float()).to(torch.bfloat16)
    wd = dequantized(w, scale, block)

    def product(rows: torch.Tensor) -> torch.Tensor:
        y = rows.float() @ wd.T
        return torch.nn.functional.silu(y[:, :n]) * y[:, n:] if act else y

    emulated, w8a16 = product(quantize_groups(q)), product(a)
    sizes = {"tokens": m, "samples": m, "batch": m}
    results = []
    for label in [v.label for v in kernel.candidates if v.max_rows is None and not v.min_sizes]:
        chosen = next(v for v in kernel.candidates if v.label == label)
        env = {roles["x"]: x, roles["weight"]: w, roles["scale"]: scale,
               roles["out"]: torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)}
        env |= {name: torch.zeros(tuple(sizes.get(d, d) for d in t.shape), dtype=TORCH[t.dtype.name], device="cuda")
                for name, t in kernel.candidate_scratch.items()}
        if roles["x2"]:
            env[roles["x2"]] = x2
        if roles["norm"]:
            env[roles["norm"]] = g
        if roles["sum"]:
            env[roles["sum"]] = torch.zeros_like(x)
        row = {"kernel": kernel.node, "variant": label, "rows": m, "n": w_rows, "k": k, "block": list(block)}
        try:
            runner.run(chosen.launches, env, sizes)
            runner.sync()
            out = env[roles["out"]]
            if "gemm.quantized" in env:
                row |= quantized_rows_case(env["gemm.quantized"], env["gemm.row_scales"], q)
            row |= {"err_vs_emulated": rel_error(out, emulated), "err_vs_w8a16": rel_error(out, w8a16),
                    "emulated_vs_w8a16": rel_error(emulated, w8a16),
                    "err_vs_emulated_by_1024_rows": [rel_error(out[i:i + 1024], emulated[i:i + 1024])
                                                     for i in range(0, m, 1024)]}
            row["us"] = runner.time_us(chosen.launches[-1:], env, sizes)
            if len(chosen.launches) > 1:
                row["rows_us"] = runner.time_us(chosen.launches[:-1], env, sizes)
            row["tflops"] = 2 * m * w_rows * k / row["us"] / 1e6
        except Exception as error:  # recorded; the other cases still run
            row["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        results.append(row)
    wb = wd.to(torch.bfloat16)
    us = torch_time_us(lambda: a @ wb.T)
    results.append({"kernel": kernel.node, "variant": "cublas bf16", "rows": m, "n": w_rows, "k": k, "us": us,
                    "tflops": 2 * m * w_rows * k / us / 1e6})
    return results


def check_gemms(report: dict) -> None:
    for key, name, quantization in MODELS[1:]:
        spec = load_spec(resolve_config_path(name), device="cuda", quantization=quantization)
        path = ensure_manifest(spec, SM, label=name, compile_missing=False)
        runner = Runner(path.parent.parent, manifests.load(path))
        for graph in lower(spec.graph)[0].all_graphs():
            for node in (n for n in graph.nodes if n.op == KERNEL and "linear" in n.attrs["kind"]
                         and n.name != "lm_head"):
                roles = gemm_roles(node)
                k = graph.value_types()[roles["weight"]].shape[1]
                for m in ROWS:
                    rows = gemm_case(runner, runner.kernel(graph.name, node.name), roles, k, m)
                    report.setdefault("gemm", []).extend(dict(r, model=key) for r in rows)
        del runner


def rechosen(path: Path, suffix: str, pick) -> Path:
    """A copy of the manifest with, per GEMM kernel and slot, the candidate `pick(slot key, labels)` names."""
    manifest = manifests.load(path)
    tuning: dict = {"kernels": {}}
    for kernel in (k for k in manifest.kernels if k.node != "lm_head"):
        for slot, alternatives in slots(kernel.candidates).items():
            label = pick(slot_key(slot), [v.label for v in alternatives])
            if label:
                tuning["kernels"].setdefault(f"{kernel.graph}/{kernel.node}", {})[slot_key(slot)] = {"choice": label}
    copy = path.with_name(f"{path.stem}-{suffix}.json")
    shutil.copy(path, copy)
    reselect(copy, tuning)
    return copy


def with_w8a16(path: Path) -> Path:
    """The manifest with Triton's W8A16 tile at any rows."""
    return rechosen(path, "w8a16", lambda key, labels: W8A16 if key == "any rows" and W8A16 in labels else None)


def with_w8a16_decode(path: Path) -> Path:
    """The manifest with Triton's W8A16 tiles at the decode slots."""
    return rechosen(path, "w8a16-decode", lambda key, labels: next(
        (label for label in labels if label.startswith("triton:")), None) if key != "any rows" else None)


def check_prefill(report: dict) -> None:
    for key, name, quantization in MODELS:
        model = bench.bench_model(name, quantization=quantization)
        path = ensure_manifest(model.spec, SM, label=name, compile_missing=False)
        for form, manifest in (("w8a8", path), ("w8a16", with_w8a16(path))) if key != "bf16" else (("bf16", path),):
            engine = bench.engine_for(model, manifest, max_tokens=max(PROMPTS), max_batch=1,
                                      max_model_len=max(PROMPTS) + 64)
            rows = bench.bench_prefill(engine, PROMPTS)
            report.setdefault("prefill", []).append({"model": key, "form": form, "rows": bench.as_json(rows)})
            print(key, form, bench.format_prefill(rows), sep="\n", flush=True)
            del engine
        del model


def check_decode(report: dict) -> None:
    """Decode steps (CUDA graphs, context 128 and 1024) of bf16 and both FP8 forms, each against its floor."""
    for key, name, quantization in MODELS:
        model = bench.bench_model(name, quantization=quantization)
        path = ensure_manifest(model.spec, SM, label=name, compile_missing=False)
        forms = (("w8a8", path), ("w8a16", with_w8a16_decode(path))) if key != "bf16" else (("bf16", path),)
        for form, manifest in forms:
            engine = bench.engine_for(model, manifest, max_tokens=max(DECODE_BATCHES),
                                      max_batch=max(DECODE_BATCHES), max_model_len=max(DECODE_CONTEXTS) + 64)
            rows = bench.bench_decode(engine, list(DECODE_BATCHES), list(DECODE_CONTEXTS))
            entry = {"model": key, "form": form, "rows": bench.as_json(rows)}
            if key == "fp8_block":
                entry["kernels_b1_ctx128_us"] = {k: round(v, 1) for k, v in bench.kernel_breakdown(engine, 128).items()}
            report.setdefault("decode", []).append(entry)
            print(key, form, bench.format_decode(rows), entry.get("kernels_b1_ctx128_us"), sep="\n", flush=True)
            del engine
        del model


def check_small(report: dict) -> None:
    """The small FP8 checkpoint (fp8_check.py's, 128 x 128 blocks) prefilling 2000 rows (one prompt) and 4000 (two
    packed) on the GPU, W8A8 and with Triton's W8A16 tiles, against the CPU reference, every position."""
    import numpy as np

    from pegainfer.frontends.load import load_model
    from pegainfer.runtime.batch import Chunk, Sequence
    from pegainfer.runtime.gpu.engine import EngineOptions, GpuEngine
    from pegainfer.runtime.reference_engine import ReferenceEngine

    folder = Path(__file__).resolve().parents[2] / ".gpu" / "small_fp8_block"
    model = load_model(folder)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.spec.config.vocab_size, 2000).tolist() for _ in range(2)]
    path = ensure_manifest(model.spec, SM, label=str(folder), compile_missing=False)
    options = EngineOptions(max_tokens=4096, max_batch=4096, max_model_len=2048, kv_tokens=8192)

    def step(engine, count: int) -> np.ndarray:
        return engine.step([Chunk(Sequence(i, list(p)), 2000) for i, p in enumerate(prompts[:count])],
                           all_logits=True)

    cpu = {count: step(ReferenceEngine(model, max_tokens=4096), count) for count in (1, 2)}
    for form, manifest in (("w8a8", path), ("w8a16", rechosen(path, "triton", lambda key, labels: next(
            (label for label in labels if label.startswith("triton:")), None)))):
        engine = GpuEngine(model, manifest, options)
        for count in (1, 2):
            gpu = step(engine, count)
            error = float(np.linalg.norm(gpu.astype(np.float64) - cpu[count]) / np.linalg.norm(cpu[count]))
            report.setdefault("small", []).append({"form": form, "rows": 2000 * count, "rel_err_vs_cpu": error})
            print("small", report["small"][-1], flush=True)
        del engine


def table(report: dict) -> str:
    lines = [f"{'model':<12} {'kernel':<8} {'variant':<30} {'M':>5} {'err emu':>8} {'err w8a16':>9} {'emu-w8a16':>9} "
             f"{'us':>8} {'TF/s':>6} {'rows us':>7}"]
    for r in report.get("gemm", []):
        if "error" in r:
            lines.append(f"{r['model']:<12} {r['kernel']:<8} {r['variant']:<30} ERROR {r['error'][:60]}")
            continue
        lines.append(f"{r['model']:<12} {r['kernel']:<8} {r['variant']:<30} {r['rows']:>5} "
                     f"{r.get('err_vs_emulated', float('nan')):>8.2e} {r.get('err_vs_w8a16', float('nan')):>9.2e} "
                     f"{r.get('emulated_vs_w8a16', float('nan')):>9.2e} "
                     f"{r['us']:>8.1f} {r['tflops']:>6.0f} {r.get('rows_us', 0):>7.1f}")
    for r in report.get("gemm", []):
        if "values_differing" in r:
            lines.append(f"rows {r['model']:<12} {r['kernel']:<8} M{r['rows']:<5} scales err {r['scales_rel_err']:.2e} "
                         f"values differing {r['values_differing']:.2e} values err {r['values_err']:.2e}")
    for r in report.get("small", []):
        lines.append(f"small block prefill of {r['rows']} rows {r['form']:<6} rel err vs CPU {r['rel_err_vs_cpu']:.4f}")
    for d in report.get("decode", []):
        lines.append(f"decode {d['model']:<12} {d['form']:<6} " + "  ".join(
            f"b{r['batch']} ctx{r['context']}: {r['ms_per_step']:.2f} ms ({r['floor_ms']:.2f})" for r in d["rows"]))
    for p in report.get("prefill", []):
        lines.append(f"prefill {p['model']:<12} {p['form']:<6} " + "  ".join(
            f"{row['prompt_tokens']}: {row['ttft_ms']:.1f} ms" for row in p["rows"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", nargs="*", default=[], choices=["small", "decode", "gemm", "prefill"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    sections = (("small", check_small), ("decode", check_decode), ("gemm", check_gemms), ("prefill", check_prefill))
    for name, section in sections:
        if name in args.skip:
            continue
        try:
            section(report)
        except Exception as error:  # recorded; the next section still runs
            report[f"{name}_error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        (args.out / "w8a8.json").write_text(json.dumps(report, indent=1))
    print(table(report))


if __name__ == "__main__":
    main()
