"""On the lent GPU (scripts/gpu/run.sh): the GPU engine against the CPU reference and Hugging Face bf16 on a
small random Qwen3, and the decode benchmark on the full Qwen3-4B shape with random weights. Prints a table last;
every number also goes to $OUT/results.json."""

import argparse
import json
import time
import traceback
from pathlib import Path

import numpy as np

from pegainfer.frontends.load import LoadedModel, embedded_configs, load_model
from pegainfer.runtime import bench
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.device import visible_sm
from pegainfer.runtime.gpu.engine import EngineOptions
from pegainfer.runtime.gpu.start import ensure_manifest, gpu_engine
from pegainfer.runtime.reference_engine import ReferenceEngine

SMALL = EngineOptions(max_tokens=512, max_batch=64, max_model_len=256, kv_tokens=32 * 256)  # the small checkpoints'


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours.astype(np.float64) - theirs) / np.linalg.norm(theirs.astype(np.float64)))


def teacher_forced(engine, prompts: list[list[int]], continuations: list[list[int]],
                   lora_slots: list[int] | None = None) -> list[np.ndarray]:
    """Logits at the last prompt position and after each forced token, per prompt: [steps + 1, vocab]; with
    `lora_slots`, each prompt's adapter slot of a LoRA engine (-1: none)."""
    seqs = [Sequence(i, list(p), lora_slot=slot) for i, (p, slot) in
            enumerate(zip(prompts, lora_slots or [-1] * len(prompts)))]
    rows = [[] for _ in prompts]
    logits = engine.step([Chunk(s, len(s.token_ids)) for s in seqs])
    for step in range(len(continuations[0]) + 1):
        for i in range(len(seqs)):
            rows[i].append(logits[i])
        if step == len(continuations[0]):
            break
        for seq, tokens in zip(seqs, continuations):
            seq.token_ids.append(tokens[step])
        logits = engine.step([Chunk(s, 1) for s in seqs])
    for seq in seqs:
        engine.release(seq)
    return [np.stack(r) for r in rows]


def mixed_forced(engine, prompts, continuations, decoding: int, chunk: int = 200) -> list[np.ndarray]:
    """Teacher-forced as teacher_forced is, but only the first `decoding` prompts are prefilled first: the others
    go in chunks of `chunk` tokens beside their decode tokens (mixed steps, decode rows first as the scheduler packs
    them), then decode too. Rows from each prompt's last token on."""
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    first = engine.step([Chunk(s, len(s.token_ids)) for s in seqs[:decoding]])
    for i in range(decoding):
        rows[i].append(first[i])
    wanted = len(continuations[0]) + 1
    while any(len(r) < wanted for r in rows):
        chunks = []
        for i, seq in enumerate(seqs):
            if len(rows[i]) == wanted:
                continue
            if seq.num_cached < len(prompts[i]):
                chunks.append((i, Chunk(seq, min(chunk, len(prompts[i]) - seq.num_cached))))
            else:
                seq.token_ids.append(continuations[i][len(rows[i]) - 1])
                chunks.append((i, Chunk(seq, 1)))
        chunks.sort(key=lambda item: item[1].num_tokens != 1)
        logits = engine.step([c for _, c in chunks])
        for row, (i, _) in enumerate(chunks):
            if seqs[i].num_cached >= len(prompts[i]):  # a decode token, or the chunk that ends the prompt
                rows[i].append(logits[row])
    for seq in seqs:
        engine.release(seq)
    return [np.stack(r) for r in rows]


def hf_gate(folder: Path, prompts, steps: int, ours_fn, results: dict) -> None:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    continuations, hf_rows = hf_greedy(model, prompts, steps)
    results["hf_gate"] = gate_stats(hf_rows, ours_fn(prompts, continuations))
    # the same positions with each prompt run alone: batch-1 steps launch other kernels (one-row GEMVs, split-KV
    # attention) than batched ones
    results["hf_gate_batch1"] = gate_stats(hf_rows, [ours_fn([p], [c])[0] for p, c in zip(prompts, continuations)])


def gate_against(model, prompts, steps: int, ours_fn) -> dict:
    """Teacher-forced on HF's greedy tokens: argmax regret and |delta logprob| over HF's top 8, per position."""
    continuations, hf_rows = hf_greedy(model, prompts, steps)
    return gate_stats(hf_rows, ours_fn(prompts, continuations))


def hf_greedy(model, prompts, steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """HF's greedy continuation of each prompt and its logits rows from the prompt's last token on."""
    import torch

    continuations, hf_rows = [], []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(steps):
                tokens.append(int(model(torch.tensor([tokens]).cuda()).logits[0, -1].argmax()))
            logits = model(torch.tensor([tokens]).cuda()).logits[0].float().cpu().numpy()
            continuations.append(tokens[len(prompt):])
            hf_rows.append(logits[len(prompt) - 1:])
    return continuations, hf_rows


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def gate_stats(hf_rows: list[np.ndarray], ours: list[np.ndarray]) -> dict:
    regrets, deltas = [], []
    for theirs, mine in zip(hf_rows, ours):
        hf_lp, our_lp = log_softmax(theirs.astype(np.float64)), log_softmax(mine.astype(np.float64))
        for h, o in zip(hf_lp, our_lp):
            regrets.append(h.max() - h[o.argmax()])
            top8 = np.argsort(-h)[:8]
            deltas += list(np.abs(o[top8] - h[top8]))
    deltas = np.array(deltas)
    return {"argmax_regret_max": float(max(regrets)), "argmax_flips": int(np.count_nonzero(regrets)),
            "mean_abs_dlogprob_top8": float(deltas.mean()),
            "p99_abs_dlogprob_top8": float(np.percentile(deltas, 99)), "max_abs_dlogprob_top8": float(deltas.max()),
            "positions": len(regrets)}


def check_small(folder: Path, results: dict, hf_folder: Path | None = None, kv_cache_dtype: str = "auto") -> None:
    """The GPU engine against the CPU reference, then against Hugging Face bf16 on `hf_folder` (by default the
    checkpoint itself; an FP8 one's dequantized copy)."""
    model = load_model(folder, kv_cache_dtype=kv_cache_dtype)
    gpu = gpu_engine(model, SMALL)
    cpu = ReferenceEngine(model, max_tokens=32 * 256)
    rng = np.random.default_rng(0)
    vocab = model.spec.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 17, 1, 33)]

    seqs_g = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    seqs_c = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    g = gpu.step([Chunk(s, len(s.token_ids)) for s in seqs_g], all_logits=True)
    c = cpu.step([Chunk(s, len(s.token_ids)) for s in seqs_c], all_logits=True)
    results["small_prefill_rel_err_vs_cpu"] = relative_error(g, c)
    for seq in [*seqs_g]:
        gpu.release(seq)
    for seq in seqs_c:
        cpu.release(seq)

    forced = [rng.integers(0, vocab, 16).tolist() for _ in prompts]
    ours = teacher_forced(gpu, prompts, forced)
    reference = teacher_forced(cpu, prompts, forced)
    results["small_decode_graphs_rel_err_vs_cpu"] = max(relative_error(o, r) for o, r in zip(ours, reference))
    results["small_decode_argmax_agreement"] = float(np.mean([(o.argmax(-1) == r.argmax(-1)).mean()
                                                              for o, r in zip(ours, reference)]))
    first = teacher_forced(gpu, prompts[:1], forced[:1])[0]
    second = teacher_forced(gpu, prompts[:1], forced[:1])[0]
    results["small_batch1_replay_bit_identical"] = bool(np.array_equal(first, second))
    for batch in (9, 17):
        batch_prompts = [rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() for _ in range(batch)]
        batch_forced = [rng.integers(0, vocab, 4).tolist() for _ in range(batch)]
        ours = teacher_forced(gpu, batch_prompts, batch_forced)
        reference = teacher_forced(cpu, batch_prompts, batch_forced)
        results[f"small_graph_batch{batch}_rel_err_vs_cpu"] = max(relative_error(o, r) for o, r in zip(ours, reference))
    hf_gate(hf_folder or folder, prompts, 16, lambda p, cont: teacher_forced(gpu, p, cont), results)
    soft = folder.with_name(folder.name + "_soft")
    if soft.is_dir():
        soft_gpu = gpu_engine(load_model(soft), SMALL)
        gate: dict = {}
        hf_gate(soft, prompts, 16, lambda p, cont: teacher_forced(soft_gpu, p, cont), gate)
        results["hf_gate_logit_std_2"] = gate["hf_gate"]


def check_sampling(folder: Path, results: dict) -> None:
    """The sampler tail on the GPU (scripts/gpu/sampling_check.py): the small model and the Qwen3-4B shape."""
    import sampling_check

    small = gpu_engine(load_model(folder), SMALL)
    large_model = bench.bench_model("qwen3-4b")
    large = bench.engine_for(large_model, manifest_4b(large_model), max_tokens=512, max_batch=64, max_model_len=1280)
    sampling_check.run(small, large, results)


def bench_4b(results: dict) -> None:
    """`pegainfer bench decode` and `prefill` on the Qwen3-4B shape, and Hugging Face eager decode beside it."""
    started = time.perf_counter()
    model = bench.bench_model("qwen3-4b")
    manifest = manifest_4b(model)
    engine = bench.engine_for(model, manifest, max_tokens=64, max_batch=64, max_model_len=1280)
    results["qwen3_4b_engine_start_s"] = time.perf_counter() - started
    rows = bench.bench_decode(engine, [1, 8, 32, 64], [128, 1024])
    rows += bench.bench_decode(engine, [1], [128], graphs=False)
    results["qwen3_4b_decode"] = bench.as_json(rows)
    print(bench.format_decode(rows))
    engine.executor.pdl_max_tokens, engine.graphs = 0, {}  # the same without programmatic dependent launch
    no_pdl = bench.bench_decode(engine, [1, 8], [128])
    results["qwen3_4b_decode_no_pdl"] = bench.as_json(no_pdl)
    engine.executor.pdl_max_tokens, engine.graphs = engine.options.pdl_max_tokens, {}
    for context in (128, 1024):
        results[f"qwen3_4b_kernels_b1_ctx{context}_us"] = {k: round(v, 1) for k, v in
                                                           bench.kernel_breakdown(engine, context).items()}
    del engine
    prefill = bench.engine_for(model, manifest, max_tokens=8192, max_batch=1, max_model_len=8208)
    rows = bench.bench_prefill(prefill, [1024, 4096, 8192])
    results["qwen3_4b_prefill"] = bench.as_json(rows)
    print(bench.format_prefill(rows))


def decode_4b(results: dict, key: str, batches: list[int], contexts: list[int], **options):
    """bench.bench_decode on the Qwen3-4B shape, random weights (`options`: bench_model's quantization and
    kv_cache_dtype), its rows in results[key]; returns the engine, for more."""
    model = bench.bench_model("qwen3-4b", **options)
    manifest = ensure_manifest(model.spec, visible_sm(), label="qwen3-4b", compile_missing=False)
    engine = bench.engine_for(model, manifest, max_tokens=max(batches), max_batch=max(batches),
                              max_model_len=max(contexts) + 64)
    rows = bench.bench_decode(engine, batches, contexts)
    results[key] = bench.as_json(rows)
    print(key, bench.format_decode(rows), sep="\n")
    return engine


def gate_4b(results: dict, logit_std: float = 2.0, cases: list[str] | None = None) -> None:
    """The golden gate on the full Qwen3-4B shape: Hugging Face's random init (bf16, on this GPU), its final norm
    scaled so that the logits spread `logit_std` (as the small checkpoints are), and the same weights handed to
    our engine; teacher-forced at batch 4 (prompts of different lengths), at batch 1 replayed twice, at graph
    batches just past bucket edges (9; 17, 33, 65 and 129: the first steps of the 32-, 64-, 128- and 256-row
    slots), and through mixed steps (decode rows beside prompt chunks of 200 tokens)."""
    hf, spread = random_hf_4b(logit_std)
    vocab = hf.config.vocab_size
    spec = bench.bench_model("qwen3-4b").spec
    model = LoadedModel(spec, Path("qwen3-4b"), hf_weights(hf, spec.graph.checkpoint_params()))
    engine = bench.engine_for(model, manifest_4b(model), max_tokens=4096, max_batch=136, max_model_len=512)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (7, 30, 1, 61)]
    gate = results["qwen3_4b_hf_gate"] = {"logits_std_before_scaling": spread}  # kept if a later case fails
    forced = lambda p, cont: teacher_forced(engine, p, cont)  # noqa: E731
    batch9 = [rng.integers(0, vocab, int(rng.integers(1, 40))).tolist() for _ in range(9)]
    graph = {size: [rng.integers(0, vocab, int(rng.integers(1, 24))).tolist() for _ in range(size)]
             for size in (17, 33, 65, 129)}
    mixed = [rng.integers(0, vocab, n).tolist() for n in (3, 9, 1, 17, 5, 12, 300, 450)]
    runs = {"batch4": lambda: gate_against(hf, prompts, 16, forced),
            "batch1": lambda: gate_against(hf, prompts[:1], 16, forced),
            "batch1_replay_bit_identical": lambda: bool(np.array_equal(*(
                teacher_forced(engine, prompts[:1], [[1] * 8])[0] for _ in range(2)))),
            "graph_batch9": lambda: gate_against(hf, batch9, 4, forced),
            **{f"graph_batch{size}": (lambda b=batch: gate_against(hf, b, 4, forced)) for size, batch in graph.items()},
            "mixed_steps": lambda: gate_against(hf, mixed, 4, lambda p, c: mixed_forced(engine, p, c, decoding=6)),
            # the same prompts prefilled whole before any decode: what the mixed steps are to be compared with
            "mixed_prompts_prefilled": lambda: gate_against(hf, mixed, 4, forced),
            "reference_noise": lambda: reference_noise(hf, engine, [*prompts, *graph[129][:32]], 8)}
    for name, run in runs.items():
        if cases is None or name in cases:
            gate[name] = run()


def random_hf_4b(logit_std: float):
    """Hugging Face's random init of the Qwen3-4B shape (bf16, drawn on this GPU, seed 0), its final norm scaled so
    that the logits spread `logit_std`; and the spread before."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device("cuda"):  # the 4B random init drawn by the GPU, not the host
        hf = transformers.AutoModelForCausalLM.from_config(qwen3_4b_hf_config(), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        spread = hf(torch.randint(0, hf.config.vocab_size, (1, 64), device="cuda")).logits.float().std().item()
        hf.model.norm.weight.mul_(logit_std / spread)
    return hf, spread


def hf_weights(hf, wanted) -> dict[str, np.ndarray]:
    """The model's tensors our graph reads (`wanted`: checkpoint names), as bf16 NumPy arrays on the host."""
    import ml_dtypes
    import torch

    weights = {name: t.detach().cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
               for name, t in hf.state_dict().items() if name in wanted}
    missing = sorted(set(wanted) - set(weights))
    assert not missing, f"Hugging Face's state dict lacks {missing[:3]}"
    return weights


def reference_noise(hf, engine, prompts: list[list[int]], steps: int) -> dict:
    """How far Hugging Face bf16 itself is from the same weights in float32, beside how far ours is, both on
    HF bf16's greedy tokens: the part of the gate's figures that is the bf16 reference's own rounding."""
    import copy

    import torch

    continuations, bf16_rows = hf_greedy(hf, prompts, steps)
    hf32 = copy.deepcopy(hf).float()
    fp32_rows = []
    with torch.no_grad():
        for prompt, continuation in zip(prompts, continuations):
            tokens = torch.tensor([[*prompt, *continuation]]).cuda()
            fp32_rows.append(hf32(tokens).logits[0].float().cpu().numpy()[len(prompt) - 1:])
    del hf32
    torch.cuda.empty_cache()
    ours = teacher_forced(engine, prompts, continuations)
    return {"hf_bf16_vs_fp32": gate_stats(fp32_rows, bf16_rows), "ours_vs_hf_fp32": gate_stats(fp32_rows, ours),
            "ours_vs_hf_bf16": gate_stats(bf16_rows, ours)}


def manifest_4b(model: LoadedModel) -> Path:
    """The Qwen3-4B shape's manifest for the visible GPU, compiled first where it is missing."""
    return ensure_manifest(model.spec, visible_sm(), label="qwen3-4b")


def qwen3_4b_hf_config():
    import transformers

    return transformers.AutoConfig.for_model(**{k: v for k, v in json.loads(
        embedded_configs()["qwen3-4b"].read_text()).items() if k not in ("architectures", "torch_dtype")})


def hf_decode(results: dict, steps: int = 16) -> None:
    """Hugging Face transformers eager, dynamic cache, bf16, random Qwen3-4B: ms per decode step after a
    128-token prompt, at batch 1 and 8."""
    import torch
    import transformers

    config = qwen3_4b_hf_config()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    table = {}
    with torch.no_grad():
        for batch in (1, 8):
            ids = torch.randint(0, config.vocab_size, (batch, 128), device="cuda")
            out = model(ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times = []
            for step in range(steps + 3):
                torch.cuda.synchronize()
                began = time.perf_counter()
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if step >= 3:
                    times.append(time.perf_counter() - began)
            table[f"b{batch} ctx128"] = float(np.median(times) * 1e3)
    results["hf_eager_decode_ms"] = table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--gate-cases", nargs="*", help="only these cases of the 4B gate (all by default)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    sections = (("small", lambda: check_small(args.small, results)),
                ("sampling", lambda: check_sampling(args.small, results)), ("bench", lambda: bench_4b(results)),
                ("gate4b", lambda: gate_4b(results, cases=args.gate_cases)), ("hf", lambda: hf_decode(results)))
    run_sections(sections, args.skip, args.out, results)


def run_sections(sections, skip: list[str], out: Path, results: dict) -> None:
    """Runs each (name, function) not skipped, reporting a failure and going on, writes out/results.json after
    each, then prints every figure that is not a table."""
    for name, run in sections:
        if name in skip:
            continue
        try:
            run()
        except Exception:  # noqa: BLE001  report every section, whatever fails
            results[f"{name}_error"] = traceback.format_exc()
            print(results[f"{name}_error"])
        (out / "results.json").write_text(json.dumps(results, indent=1))
    for key, value in results.items():
        if isinstance(value, list):
            continue  # printed as tables above
        if isinstance(value, dict):
            for sub, figure in value.items():
                print(f"{key:>28} {sub:<28} {json.dumps(figure)}")
        elif not key.endswith("_error"):
            print(f"{key:>28} {value}")


if __name__ == "__main__":
    main()
