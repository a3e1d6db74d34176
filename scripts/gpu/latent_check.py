"""On the lent GPU (scripts/gpu/prepare_latent.sh first): the latent-attention MoE models on the GPU engine against
the CPU reference and Hugging Face bf16 on small random DeepSeek-V2 and V3 checkpoints, and a block-scaled FP8 V3
one (prefill, decode through CUDA graphs), prompts long enough for the grouped expert GEMMs (steps above 64 rows) and mixed steps against the
CPU, then decode and prefill on the full DeepSeek-V2-Lite shape with random weights. Prints a table last; every
number also goes to $OUT/results.json."""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import check  # noqa: E402  (scripts/gpu/check.py: the shared GPU checks)
import recurrent_check  # noqa: E402  (its profile_prefill: GPU time of one prompt by kernel)

from pegainfer.frontends.load import load_model  # noqa: E402
from pegainfer.runtime import bench  # noqa: E402
from pegainfer.runtime.batch import Chunk, Sequence  # noqa: E402
from pegainfer.runtime.device import visible_sm  # noqa: E402
from pegainfer.runtime.gpu.start import ensure_manifest, gpu_engine  # noqa: E402
from pegainfer.runtime.reference_engine import ReferenceEngine  # noqa: E402


def check_small(folder: Path, prefix: str, results: dict, hf_folder: Path | None = None) -> None:
    """check.check_small (GPU against the CPU reference and Hugging Face), its figures prefixed."""
    figures: dict = {}
    check.check_small(folder, figures, hf_folder)
    results.update({f"{prefix}_{key}": value for key, value in figures.items()})


def check_long(folder: Path, prefix: str, results: dict) -> None:
    """A 440-row prefill (the grouped expert GEMMs; each prompt's last logits) and mixed steps of 100-token chunks,
    against the CPU."""
    model = load_model(folder)
    gpu, cpu = gpu_engine(model, check.SMALL), ReferenceEngine(model, max_tokens=32 * 256)
    rng = np.random.default_rng(4)
    vocab = model.spec.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (150, 200, 90)]
    logits = []
    for engine in (gpu, cpu):
        seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
        logits.append(engine.step([Chunk(s, len(s.token_ids)) for s in seqs]))
        for seq in seqs:
            engine.release(seq)
    results[f"{prefix}_prefill440_rel_err_vs_cpu"] = check.relative_error(*logits)
    prompts += [rng.integers(0, vocab, n).tolist() for n in (3, 9, 1)]
    forced = [rng.integers(0, vocab, 6).tolist() for _ in prompts]
    ours = check.mixed_forced(gpu, prompts[3:] + prompts[:3], forced, decoding=3, chunk=100)
    reference = check.mixed_forced(cpu, prompts[3:] + prompts[:3], forced, decoding=3, chunk=100)
    results[f"{prefix}_mixed_rel_err_vs_cpu"] = max(check.relative_error(o, r) for o, r in zip(ours, reference))
    results[f"{prefix}_mixed_argmax_agreement"] = float(np.mean([(o.argmax(-1) == r.argmax(-1)).mean()
                                                                 for o, r in zip(ours, reference)]))


def check_noise(folder: Path, prefix: str, results: dict) -> None:
    """The GPU's bf16 prefill logits and the CPU reference's bf16 ones, each against the CPU reference in float32:
    how far bf16 rounding alone moves this random model (a router's near ties flip with it)."""
    logits = {}
    for name, dtype in (("float32", "float32"), ("cpu_bf16", "bfloat16"), ("gpu_bf16", "bfloat16")):
        model = load_model(folder, dtype=dtype)
        engine = gpu_engine(model, check.SMALL) if name == "gpu_bf16" else ReferenceEngine(model, max_tokens=512)
        prompts = [np.random.default_rng(7).integers(0, model.spec.config.vocab_size, n).tolist()
                   for n in (5, 17, 1, 33)]
        seqs = [Sequence(i, p) for i, p in enumerate(prompts)]
        logits[name] = np.asarray(engine.step([Chunk(s, len(s.token_ids)) for s in seqs], all_logits=True),
                                  np.float32)
    for name in ("cpu_bf16", "gpu_bf16"):
        results[f"{prefix}_{name}_vs_cpu_f32"] = check.relative_error(logits[name], logits["float32"])


def profile_decode(results: dict, name: str, batches=(1, 8, 64), steps: int = 5) -> None:
    """GPU time a decode step (context 128, CUDA graphs) by kernel name, from CUPTI records (torch.profiler)."""
    import torch

    model = bench.bench_model(name)
    manifest = ensure_manifest(model.spec, visible_sm(), label=name, compile_missing=False)
    engine = bench.engine_for(model, manifest, max_tokens=64, max_batch=64, max_model_len=1280)
    for batch in batches:
        seqs = bench._sequences(engine, batch, 128, steps + 3)
        for _ in range(3):
            engine.run([Chunk(s, 1) for s in seqs])
        engine.ctx.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.run([Chunk(s, 1) for s in seqs])
            engine.ctx.synchronize()
        for seq in seqs:
            engine.release(seq)
        totals: dict[str, float] = {}
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                totals[event.name] = totals.get(event.name, 0.0) + event.device_time / steps
        results[f"{name}_decode_b{batch}_kernel_us"] = dict(sorted(((k[:60], round(v, 1)) for k, v in totals.items()),
                                                                  key=lambda kv: -kv[1])[:16])
        results[f"{name}_decode_b{batch}_gpu_us"] = round(sum(totals.values()), 1)


def bench_full(results: dict, name: str) -> None:
    model = bench.bench_model(name)
    manifest = ensure_manifest(model.spec, visible_sm(), label=name, compile_missing=False)
    engine = bench.engine_for(model, manifest, max_tokens=64, max_batch=64, max_model_len=1280)
    rows = bench.bench_decode(engine, [1, 8, 32, 64], [128, 1024])
    results[f"{name}_decode"] = bench.as_json(rows)
    print(bench.format_decode(rows))
    results[f"{name}_kernels_b1_ctx128_us"] = {k: round(v, 1) for k, v in bench.kernel_breakdown(engine, 128).items()}
    del engine
    prefill = bench.engine_for(model, manifest, max_tokens=4096, max_batch=1, max_model_len=4112)
    rows = bench.bench_prefill(prefill, [1024, 4096])
    results[f"{name}_prefill"] = bench.as_json(rows)
    print(bench.format_prefill(rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--v2", type=Path, default=Path(".gpu/small_dsv2"))
    parser.add_argument("--v3", type=Path, default=Path(".gpu/small_dsv3"))
    parser.add_argument("--v3-fp8", type=Path, default=Path(".gpu/small_dsv3_fp8"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    sections = (("v2", lambda: check_small(args.v2, "v2", results)),
                ("v3", lambda: check_small(args.v3, "v3", results)),
                ("v3_long", lambda: check_long(args.v3, "v3", results)),
                ("v3_fp8", lambda: check_small(args.v3_fp8, "v3_fp8", results,
                                               args.v3_fp8.with_name(args.v3_fp8.name + "_bf16"))),
                ("v3_fp8_long", lambda: check_long(args.v3_fp8, "v3_fp8", results)),
                ("v2_long", lambda: check_long(args.v2, "v2", results)),
                ("noise", lambda: [check_noise(folder, prefix, results) for folder, prefix in
                                   ((args.v2, "v2"), (args.v3, "v3"), (args.v3_fp8, "v3_fp8"))]),
                ("bench", lambda: bench_full(results, "deepseek-v2-lite")),
                ("profile", lambda: profile_decode(results, "deepseek-v2-lite")),
                ("profile_prefill", lambda: recurrent_check.profile_prefill(results, "deepseek-v2-lite")))
    check.run_sections(sections, args.skip, args.out, results)


if __name__ == "__main__":
    main()
