"""On the lent GPU (after scripts/gpu/prepare_fp8.sh): FP8 weights. Each small FP8 checkpoint on the GPU engine
against the CPU reference (prefill, graph decode, graph batches 9 and 17, batch-1 replay) and against Hugging Face
bf16 on its dequantized copy (the gate's statistics), and a 320-row prefill (the 64-row tiles) against the CPU;
then decode steps of the Qwen3-4B shape with bf16 weights and with `--quantization fp8`, each against its own floor. Prints a table last; every number goes to $OUT/results.json.
    carry [".gpu/small_fp8_block", ".gpu/small_fp8_block_hf", ".gpu/small_fp8_channel", ".gpu/small_fp8_channel_hf",
           ".gpu/cache_fp8"]:
    PYTHONPATH=$PYTHONPATH:scripts/gpu PEGAINFER_CACHE=$PWD/.gpu/cache_fp8 python3 scripts/gpu/fp8_check.py --out $OUT/fp8
(source env.sh first)"""

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
from check import SMALL, check_small, decode_4b, gate_stats, relative_error, run_sections

from pegainfer.frontends.load import load_model
from pegainfer.runtime import bench
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.gpu.start import gpu_engine
from pegainfer.runtime.reference_engine import ReferenceEngine

GPU = Path(__file__).resolve().parents[2] / ".gpu"  # what prepare_fp8.sh made


def check_prefill(folder: Path, results: dict) -> None:
    """One packed prefill of four prompts (320 rows: past 64, the prefill tiles) on the GPU against the CPU
    reference, every position: relative error and the gate's statistics with the reference as truth."""
    model = load_model(folder)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.spec.config.vocab_size, n).tolist() for n in (65, 75, 85, 95)]
    rows = {}
    every_row = replace(SMALL, max_batch=512)  # a logits row a token
    for name, engine in (("gpu", gpu_engine(model, every_row)), ("cpu", ReferenceEngine(model, max_tokens=1024))):
        seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
        rows[name] = engine.step([Chunk(s, len(s.token_ids)) for s in seqs], all_logits=True)
    results["prefill_320_rows_rel_err_vs_cpu"] = relative_error(rows["gpu"], rows["cpu"])
    results["prefill_320_rows_gate_vs_cpu"] = gate_stats([rows["cpu"]], [rows["gpu"]])


def bench_fp8(results: dict, batches: list[int], contexts: list[int]) -> None:
    for quantization in (None, "fp8"):
        engine = decode_4b(results, f"qwen3_4b_decode_{quantization or 'bf16'}", batches, contexts,
                           quantization=quantization)
        if quantization:
            results["qwen3_4b_fp8_kernels_b1_ctx128_us"] = {k: round(v, 1) for k, v in
                                                             bench.kernel_breakdown(engine, 128).items()}
        del engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--batch", default="1,16,64")
    parser.add_argument("--context", default="128,1024")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    sections = [(f"small_{form}", lambda form=form: check_small(
        GPU / f"small_fp8_{form}", results.setdefault(f"small_fp8_{form}", {}),
        hf_folder=GPU / f"small_fp8_{form}_hf")) for form in ("block", "channel")]
    sections += [(f"prefill_{form}", lambda form=form: check_prefill(
        GPU / f"small_fp8_{form}", results.setdefault(f"prefill_{form}", {}))) for form in ("block", "channel")]
    sections.append(("bench", lambda: bench_fp8(results, [int(b) for b in args.batch.split(",")],
                                                [int(c) for c in args.context.split(",")])))
    run_sections(sections, args.skip, args.out, results)


if __name__ == "__main__":
    main()
