"""On the lent GPU (called by check.py): the sampler tail's kernels against the `sample` op's NumPy reference on
the same logits (the logits the step wrote, fetched back), for mixed per-row parameters over prefill, eager and
CUDA-graph decode steps; and a decode step's time and download when it samples on the device (engine.sample)
against bringing the logits back (engine.step)."""

import dataclasses
import json
import time

import numpy as np

from pegainfer.ir.ops.sampling import UNRESOLVED, sample_row
from pegainfer.ir.registry import get_op
from pegainfer.ir.step import SAMPLING_INPUTS, sampler_outputs
from pegainfer.passes.fusion import TAIL_TOP_K
from pegainfer.runtime import bench
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.device_sampling import sampling_inputs
from pegainfer.runtime.gpu.engine import GpuEngine, bucket_for
from pegainfer.runtime.sampler import SamplingParams

MIXED = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20),
         SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.6, top_p=0.95, top_k=50),
         SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
         SamplingParams(temperature=0.8, top_k=1), SamplingParams(temperature=1.0, top_k=200)]


def check_tokens(engine: GpuEngine, rows: int = 9, steps: int = 4, seed: int = 0) -> dict:
    """`rows` sequences (9: a CUDA-graph bucket of 16 with padding) drawing with MIXED parameters for `steps`
    steps: the device's tokens against the reference's on the fetched logits (-1 where both leave a row to the
    host), and its logprobs."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.spec.config.vocab_size
    seqs = [Sequence(i, rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()) for i in range(rows)]
    params = [MIXED[i % len(MIXED)] for i in range(rows)]
    names = sampler_outputs(engine.executor.graph)
    stats = {"rows": 0, "token_mismatches": 0, "unresolved_rows": 0, "max_abs_dlogprob": 0.0, "mismatched": []}
    chunks = [Chunk(s, len(s.token_ids)) for s in seqs]
    for step in range(steps):
        sampling = sampling_inputs(params, [step] * rows, rng)
        outputs = engine.run(chunks, sampling=sampling)
        logits = engine.executor.fetch(outputs[engine.executor.graph.outputs[0]])[:rows].astype(np.float32)
        tokens, logprobs = (engine.executor.fetch(outputs[names[role]])[:rows]
                            for role in ("sampled_ids", "sampled_logprobs"))
        expected, expected_logprobs = get_op("sample").reference(
            logits, *(sampling[name] for name in SAMPLING_INPUTS), candidates=TAIL_TOP_K)
        settled = expected != UNRESOLVED
        stats["rows"] += rows
        stats["token_mismatches"] += int((tokens != expected).sum())
        stats["mismatched"] += [(step, int(r)) for r in np.flatnonzero(tokens != expected)]
        stats["unresolved_rows"] += int((~settled).sum())
        if settled.any():
            gap = np.abs(logprobs[settled] - expected_logprobs[settled]).max()
            stats["max_abs_dlogprob"] = max(stats["max_abs_dlogprob"], float(gap))
        for r, seq in enumerate(seqs):
            token = int(expected[r]) if settled[r] else \
                sample_row(logits[r], *(sampling[name][r].item() for name in SAMPLING_INPUTS))
            seq.token_ids.append(token)
        chunks = [Chunk(s, 1) for s in seqs]
    for seq in seqs:
        engine.release(seq)
    return stats


def time_decode(engine: GpuEngine, batches: tuple[int, ...] = (1, 64), context: int = 128, steps: int = 20) -> dict:
    """ms per decode step (CUDA graphs) and bytes downloaded: `step` (engine.step: the logits rows come back,
    nothing drawn) against engine.sample with top-p 0.95, top-k 50, T 0.8 (`sample_cut`: drawn among the
    candidates) and with T 1 and nothing cut (`sample_full`: a Gumbel-max over every logit); 8 bytes a row come
    back, plus a logits row for each row the candidates could not settle (counted in host_rows); greedy rows
    (`sample_greedy`: the tail ranks nothing) and greedy rows asking 5 top logprobs (`sample_greedy_top5`: it
    ranks the candidates, and they come back too)."""
    vocab = engine.model.spec.config.vocab_size
    itemsize = engine.executor.graph.value_types()[engine.executor.graph.outputs[0]].dtype.itemsize
    modes = {"step": None, "sample_cut": SamplingParams(temperature=0.8, top_p=0.95, top_k=50),
             "sample_full": SamplingParams(temperature=1.0), "sample_greedy": SamplingParams(temperature=0.0),
             "sample_greedy_top5": SamplingParams(temperature=0.0, logprobs=5)}
    table = {}
    for batch in batches:
        for mode, base in modes.items():
            params = [dataclasses.replace(base, seed=i) for i in range(batch)] if base else []
            seqs = bench._sequences(engine, batch, context, steps + bench.WARMUP)
            times, host_rows = [], 0
            for index in range(steps + bench.WARMUP):
                chunks = [Chunk(s, 1) for s in seqs]
                began = time.perf_counter()
                if base is None:
                    engine.step(chunks)
                else:
                    host_rows += len(engine.sample(chunks, params, [index] * batch).host_rows)
                if index >= bench.WARMUP:
                    times.append(time.perf_counter() - began)
            for seq in seqs:
                engine.release(seq)
            download = bucket_for(batch, engine.buckets) * vocab * itemsize if base is None else \
                8 * batch + host_rows * vocab * itemsize / (steps + bench.WARMUP)
            table[f"b{batch} {mode}"] = {"ms_per_step": round(float(np.median(times) * 1e3), 3),
                                         "bytes_down_per_step": int(download), "host_rows": host_rows}
    return table


def run(small: GpuEngine, large: GpuEngine | None, results: dict) -> None:
    results["sampling_small"] = check_tokens(small)
    if large is not None:
        results["sampling_qwen3_4b"] = check_tokens(large, steps=3)
        results["sampling_qwen3_4b_decode"] = time_decode(large)


def main() -> None:
    """The Qwen3-4B-shape checks alone, on random weights: `python3 scripts/gpu/sampling_check.py` (after env.sh)."""
    engine = bench.random_engine("qwen3-4b", max_tokens=2048, max_batch=64, max_model_len=512)
    results = {"sampling_qwen3_4b": check_tokens(engine, steps=3), "decode": time_decode(engine)}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
