"""On the lent GPU (after scripts/gpu/prepare_kv_fp8.sh): the FP8 KV cache. The small bf16 checkpoint with
`--kv-cache-dtype fp8` on the GPU engine against the CPU reference with the same cache (prefill, graph decode, graph
batches 9 and 17, batch-1 replay) and against Hugging Face bf16 (the gate's statistics, which now hold the cache's
rounding); then decode steps of the Qwen3-4B shape with a bf16 and an FP8 cache, each against its own floor. Prints
a table last; every number goes to $OUT/results.json.
    carry [".gpu/small_kv", ".gpu/cache_kv_fp8"]:
    . scripts/gpu/env.sh; PYTHONPATH=$PYTHONPATH:scripts/gpu PEGAINFER_CACHE=$PWD/.gpu/cache_kv_fp8 \\
        python3 scripts/gpu/kv_fp8_check.py --out $OUT/kv"""

import argparse
from pathlib import Path

from check import check_small, decode_4b, run_sections

from pegainfer.runtime import bench

GPU = Path(__file__).resolve().parents[2] / ".gpu"  # what prepare_kv_fp8.sh made


def bench_kv(results: dict, batches: list[int], contexts: list[int]) -> None:
    for kv in ("auto", "fp8"):
        engine = decode_4b(results, f"qwen3_4b_decode_kv_{kv}", batches, contexts, kv_cache_dtype=kv)
        launches = bench.kernel_breakdown(engine, max(contexts))
        results[f"qwen3_4b_kv_{kv}_b1_ctx{max(contexts)}_us"] = {k: round(v, 1) for k, v in launches.items()}
        del engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--batch", default="1,16,64,128")
    parser.add_argument("--context", default="128,1024,4096")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    sections = [("small", lambda: check_small(GPU / "small_kv", results.setdefault("small_kv_fp8", {}),
                                              kv_cache_dtype="fp8")),
                ("bench", lambda: bench_kv(results, [int(b) for b in args.batch.split(",")],
                                           [int(c) for c in args.context.split(",")]))]
    run_sections(sections, args.skip, args.out, results)


if __name__ == "__main__":
    main()
