"""On the lent GPU (scripts/gpu/prepare_recurrent.sh first): a model with recurrent layers (Qwen3.5) on the GPU
engine against the CPU reference and Hugging Face bf16 on a small random checkpoint (prefill, decode through CUDA
graphs, mixed steps whose prompt chunks carry the state), a prefix hit restoring a state snapshot against a cold
run, the small Qwen3.5-MoE against its CPU reference, then decode and prefill on the full Qwen3.5-4B shape with
random weights. Prints a table last; every number also goes to $OUT/results.json."""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import check  # noqa: E402  (scripts/gpu/check.py: the shared GPU checks)

from pegainfer.frontends.load import load_model  # noqa: E402
from pegainfer.runtime import bench  # noqa: E402
from pegainfer.runtime.batch import Chunk, Sequence  # noqa: E402
from pegainfer.runtime.device import visible_sm  # noqa: E402
from pegainfer.runtime.gpu.start import ensure_manifest, gpu_engine  # noqa: E402
from pegainfer.runtime.reference_engine import ReferenceEngine  # noqa: E402
from pegainfer.runtime.requests import EngineRequest  # noqa: E402
from pegainfer.runtime.sampler import SamplingParams  # noqa: E402
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig  # noqa: E402


def check_mixed(folder: Path, results: dict) -> None:
    """Prompt chunks of 7 tokens beside decode rows, against the CPU reference doing the same."""
    model = load_model(folder)
    gpu, cpu = gpu_engine(model, check.SMALL), ReferenceEngine(model, max_tokens=32 * 256)
    rng = np.random.default_rng(1)
    vocab = model.spec.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (3, 9, 1, 17, 40, 33)]
    forced = [rng.integers(0, vocab, 6).tolist() for _ in prompts]
    ours = check.mixed_forced(gpu, prompts, forced, decoding=3, chunk=7)
    reference = check.mixed_forced(cpu, prompts, forced, decoding=3, chunk=7)
    results["small_mixed_rel_err_vs_cpu"] = max(check.relative_error(o, r) for o, r in zip(ours, reference))
    results["small_mixed_argmax_agreement"] = float(np.mean([(o.argmax(-1) == r.argmax(-1)).mean()
                                                             for o, r in zip(ours, reference)]))


def check_batches(folder: Path, results: dict) -> None:
    """Per sequence, the GPU against the CPU reference at decode batches 5 to 17, through CUDA graphs and eagerly:
    which batches (graph buckets) and sequences stray."""
    model = load_model(folder)
    gpu, cpu = gpu_engine(model, check.SMALL), ReferenceEngine(model, max_tokens=32 * 256)
    rng = np.random.default_rng(0)
    vocab = model.spec.config.vocab_size
    table = {}
    for batch in (5, 8, 9, 12, 16, 17):
        prompts = [rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() for _ in range(batch)]
        forced = [rng.integers(0, vocab, 4).tolist() for _ in range(batch)]
        reference = check.teacher_forced(cpu, prompts, forced)
        for graphs in (True, False):
            gpu.options.cuda_graphs = graphs
            ours = check.teacher_forced(gpu, prompts, forced)
            errors = [round(check.relative_error(o, r), 4) for o, r in zip(ours, reference)]
            table[f"b{batch}_{'graphs' if graphs else 'eager'}"] = {
                "max": max(errors), "lens": [len(p) for p in prompts], "errors": errors}
    results["small_batches_per_sequence"] = table


def check_prefix(folder: Path, results: dict) -> None:
    """A prompt sharing 40 tokens with an earlier one, served from its cached blocks and the state snapshot at 32,
    against the same prompt cold (no prefix cache) on the same engine: greedy tokens and their logprobs."""
    model = load_model(folder)
    gpu = gpu_engine(model, check.SMALL)
    rng = np.random.default_rng(3)
    vocab = model.spec.config.vocab_size
    first = rng.integers(0, vocab, 45).tolist()
    second = first[:40] + rng.integers(0, vocab, 10).tolist()
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)

    def serve(prefix_cache: bool, prompts: list[list[int]]) -> list:
        scheduler = Scheduler(gpu, frozenset(), SchedulerConfig(max_num_seqs=8, prefix_cache=prefix_cache))
        outputs = []
        for i, prompt in enumerate(prompts):
            scheduler.add(EngineRequest(f"r{i}", prompt, params))
            outputs.append([])
            while scheduler.has_work():
                outputs[-1] += scheduler.step()
        return outputs[-1]
    hit, cold = serve(True, [first, second]), serve(False, [second])
    results["prefix_cached_tokens"] = hit[0].num_cached_tokens
    results["prefix_tokens_equal_cold"] = [o.token_id for o in hit] == [o.token_id for o in cold]
    results["prefix_max_logprob_delta"] = max(abs(a.logprobs[a.token_id] - b.logprobs[b.token_id])
                                              for a, b in zip(hit, cold))


def check_moe(folder: Path, results: dict) -> None:
    """The small Qwen3.5-MoE through check_small (GPU against the CPU reference and Hugging Face), prefixed moe_."""
    figures: dict = {}
    check.check_small(folder, figures)
    results.update({f"moe_{key}": value for key, value in figures.items()})


def bench_4b(results: dict, name: str) -> None:
    model = bench.bench_model(name)
    manifest = ensure_manifest(model.spec, visible_sm(), label=name, compile_missing=False)
    engine = bench.engine_for(model, manifest, max_tokens=64, max_batch=64, max_model_len=1280)
    rows = bench.bench_decode(engine, [1, 8, 32, 64], [128, 1024])
    results[f"{name}_decode"] = bench.as_json(rows)
    print(bench.format_decode(rows))
    for context in (128,):
        results[f"{name}_kernels_b1_ctx{context}_us"] = {k: round(v, 1) for k, v in
                                                         bench.kernel_breakdown(engine, context).items()}
    del engine
    prefill = bench.engine_for(model, manifest, max_tokens=4096, max_batch=1, max_model_len=4112)
    rows = bench.bench_prefill(prefill, [1024, 4096])
    results[f"{name}_prefill"] = bench.as_json(rows)
    print(bench.format_prefill(rows))


def profile_prefill(results: dict, name: str, tokens: int = 4096) -> None:
    """GPU time by kernel name of one prompt of `tokens` (CUPTI records through torch.profiler), summed over layers."""
    import torch

    model = bench.bench_model(name)
    manifest = ensure_manifest(model.spec, visible_sm(), label=name, compile_missing=False)
    engine = bench.engine_for(model, manifest, max_tokens=tokens, max_batch=1, max_model_len=tokens + 16)
    rng = np.random.default_rng(2)
    for warm in (True, False):
        seq = Sequence(0, rng.integers(0, model.spec.config.vocab_size, tokens).tolist())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.run([Chunk(seq, tokens)])
            engine.ctx.synchronize()
        engine.release(seq)
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time / 1e3
    results[f"{name}_prefill{tokens}_kernel_ms"] = dict(sorted(((k, round(v, 2)) for k, v in totals.items()),
                                                               key=lambda kv: -kv[1])[:14])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=Path, required=True)
    parser.add_argument("--small-moe", type=Path, default=Path(".gpu/small_q35_moe"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    sections = (("small", lambda: check.check_small(args.small, results)),
                ("mixed", lambda: check_mixed(args.small, results)),
                ("batches", lambda: check_batches(args.small, results)),
                ("prefix", lambda: check_prefix(args.small, results)),
                ("moe", lambda: check_moe(args.small_moe, results)),
                ("bench", lambda: bench_4b(results, "qwen3.5-4b")),
                ("profile", lambda: profile_prefill(results, "qwen3.5-4b")))
    check.run_sections(sections, args.skip, args.out, results)


if __name__ == "__main__":
    main()
