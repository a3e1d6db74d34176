"""Issue 38's figures for LoRA, speculative decoding and the host KV tier, on the Qwen3-4B shape with random bf16
weights, the GPU engine driven by the scheduler as `serve` drives it:
- lora: the median decode step at batch 1 and 32, rows of 0 / 1 / 8 distinct adapters of rank 16, against the base
  model's step (no LoRA tables), each beside its CUDA graph's own device time, and a batch-1 eager step's time by
  launch kind for both models;
- spec: ms per generated token at batch 1, greedy, against plain decode: n-gram drafting (K = 2..6) on a repetitive
  prompt, and an oracle proposer that drafts the target's own greedy continuation (every draft accepted, nothing
  spent drafting: the bound a draft model equal to the target approaches), and that draft model itself on a GPU
  engine of its own; verify steps eager and in CUDA graphs;
  the tokens checked equal to plain ones;
- eagle3: ms per generated token at batch 1 with a random EAGLE-3 head on GPU engines beside the target's, its
  tokens checked equal to plain ones;
- mtp: the same for Qwen3.5-4B's MTP head (random), K = 1..3 (its manifests in .gpu/cache_models);
- host: time to first token of a prompt whose 1k / 4k / 16k-token prefix is restored from host blocks, against
  cold prefill and a GPU prefix-cache hit.
Prints a table last; every figure also goes to $OUT/features_bench.json.

Here, once: `QWEN3_ONLY=1 bash scripts/gpu/prepare_sweeps.sh` (the base, LoRA and EAGLE-3 manifests, in
.gpu/cache_qwen3_fp8; the EAGLE-3 head's config from `features_bench.py head-config DIR`).
On the GPU, each part in a process of its own (an engine's memory goes with its process):
  . scripts/gpu/env.sh && for part in lora spec eagle3 host; do python3 scripts/gpu/features_bench.py $part; done
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

MODEL = "qwen3-4b"
LORA_SLOTS, LORA_RANK = 8, 16
DECODE_STEPS = 24
TOKENS = 150000  # prompt ids are drawn below it: ordinary tokens of the vocabulary, none special


def engine(model, **options):
    from pegainfer.runtime.gpu.engine import EngineOptions
    from pegainfer.runtime.gpu.start import gpu_engine

    return gpu_engine(model, EngineOptions(**{"max_tokens": 2048, "max_batch": 64, "max_model_len": 2048,
                                              "kv_tokens": 16 * 1024, **options}), compile_missing=False)


def scheduler(gpu, config=None, **parts):
    from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

    plain = SchedulerConfig(max_num_seqs=gpu.options.max_batch, max_model_len=2048, prefix_cache=False)
    return Scheduler(gpu, frozenset(), config or plain, **parts)


def request(rid: str, prompt: list[int], tokens: int, lora: str | None = None):
    from pegainfer.runtime.requests import EngineRequest
    from pegainfer.runtime.sampler import SamplingParams

    return EngineRequest(rid, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), lora=lora)


def decode_step_ms(sched, prompts: list[list[int]], adapters: list[str | None]) -> float:
    """The median step once every sequence decodes (prefill steps, which admit and write, left out)."""
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        sched.add(request(str(i), prompt, 8 + DECODE_STEPS, adapter))
    times, emitted = [], 0
    while sched.has_work():
        began = time.perf_counter()
        out = sched.step()
        elapsed = time.perf_counter() - began
        if emitted >= len(prompts) and len(out) == len(prompts):  # every sequence past its first token
            times.append(elapsed)
        emitted += len(out)
    return float(np.median(times[2:]) * 1e3)


def random_adapter(name: str, graph, rng):
    from pegainfer.frontends.lora import Adapter, adapter_rows, lora_modules

    adapter = Adapter(name, Path(name), LORA_RANK, 2.0)
    for group in lora_modules(graph).values():
        for module, out in zip(group.modules, group.outs):
            adapter.modules[module] = ((rng.standard_normal((LORA_RANK, group.size_in)) * 0.01).astype(np.float32),
                                       (rng.standard_normal((out, LORA_RANK)) * 0.01).astype(np.float32))
    adapter.rows = adapter_rows(adapter, graph)  # as read_adapter leaves it
    return adapter


def bench_lora(results: dict) -> None:
    from pegainfer.frontends.lora import LoraConfig, lora_model
    from pegainfer.runtime.bench import bench_model, kernel_breakdown
    from pegainfer.runtime.lora import LoraSlots

    model = bench_model(MODEL)
    rng = np.random.default_rng(0)
    prompts = {batch: [rng.integers(10, TOKENS, 64).tolist() for _ in range(batch)] for batch in (1, 32)}
    base = engine(model)
    for batch, rows in prompts.items():
        results[f"lora_b{batch}_base_ms"] = round(decode_step_ms(scheduler(base), rows, [None] * batch), 3)
        results[f"lora_b{batch}_base_device_ms"] = round(replay_ms(base, batch, frozenset()), 3)
    results["lora_breakdown_base_us"] = top_kinds(kernel_breakdown(base, 128))
    del base
    config = LoraConfig(LORA_SLOTS, LORA_RANK)
    tuned = engine(lora_model(model, config))
    slots = LoraSlots(tuned.graph, config, tuned.write_lora)
    for i in range(LORA_SLOTS):
        slots.register(random_adapter(f"a{i}", tuned.graph, rng))
    for batch, rows in prompts.items():
        for distinct in (0, 1, 8):
            names = [None if distinct == 0 else f"a{i % distinct}" for i in range(batch)]
            ms = decode_step_ms(scheduler(tuned, lora=slots), rows, names)
            results[f"lora_b{batch}_{distinct}_adapters_ms"] = round(ms, 3)
            skip = frozenset() if distinct else frozenset({"lora_add"})
            results[f"lora_b{batch}_{distinct}_adapters_device_ms"] = round(replay_ms(tuned, batch, skip), 3)
    results["lora_breakdown_0_adapters_us"] = top_kinds(kernel_breakdown(tuned, 128))


def replay_ms(gpu, batch: int, skip: frozenset[str], repeats: int = 20) -> float:
    """The device's own time of the decode graph a batch replays (the host's work left out), from CUDA events
    around back-to-back replays: what decode_step_ms adds beside it is the host's."""
    from pegainfer.runtime.cuda import driver
    from pegainfer.runtime.gpu.engine import bucket_for

    graphs, _ = gpu.graphs[(bucket_for(batch, gpu.buckets), 1, False, skip)]
    start, end = driver.Event(), driver.Event()
    start.record(gpu.ctx.stream)
    for _ in range(repeats):
        for graph in graphs:
            graph.replay()
    end.record(gpu.ctx.stream)
    gpu.ctx.synchronize()
    return end.seconds_since(start) * 1e3 / repeats


def top_kinds(totals: dict[str, float], count: int = 10) -> dict[str, float]:
    """The launch kinds of a batch-1 eager step (bench.kernel_breakdown) taking the most microseconds."""
    return {name: round(us, 1) for name, us in list(totals.items())[:count]}


class OracleProposer:
    """Drafts the continuation a plain greedy run produced: every draft is the target's own next token."""

    def __init__(self, continuation: list[int], prompt_len: int) -> None:
        self.continuation, self.prompt_len = continuation, prompt_len

    def propose(self, requests) -> list[list[int]]:
        done = [len(r.tokens) - self.prompt_len for r in requests]
        return [self.continuation[d:d + r.k] for r, d in zip(requests, done)]

    def release(self, seq_id: int) -> None:
        pass


def generate(gpu, prompt: list[int], tokens: int, speculator=None) -> tuple[list[int], float, object]:
    """Greedy tokens of one request and the ms per generated token (its first token's step left out)."""
    sched = scheduler(gpu, speculator=speculator)
    sched.add(request("0", prompt, tokens))
    out, began = [], None
    while sched.has_work():
        out += [t.token_id for t in sched.step()]
        if began is None and out:
            began, first = time.perf_counter(), len(out)
    return out, (time.perf_counter() - began) * 1e3 / (len(out) - first), sched.stats


def bench_spec(results: dict) -> None:
    from pegainfer.runtime.bench import bench_model
    from pegainfer.runtime.proposers import DraftModelProposer, NgramProposer
    from pegainfer.runtime.speculative import Speculator, parse_speculative_config

    model = bench_model(MODEL)
    gpu = engine(model, max_batch=8, max_samples=8 * 7)
    rng = np.random.default_rng(1)
    prompt, tokens = (rng.integers(10, TOKENS, 24).tolist() * 16)[:384], 256
    plain, ms, _ = generate(gpu, prompt, tokens)
    plain, ms, _ = generate(gpu, prompt, tokens)  # the second run: graphs captured, pages touched
    results["spec_plain_ms_per_token"] = round(ms, 3)
    draft = engine(model, max_batch=8)  # a draft model equal to the target, on a GPU engine of its own
    for k in range(2, 7):
        for method in ("ngram", "oracle", "draft"):
            for verify in ("eager", "graphs"):
                gpu.options.verify_tokens = k + 1 if verify == "graphs" else 0
                config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": k})
                proposer = {"ngram": lambda: NgramProposer(config),
                            "oracle": lambda: OracleProposer(plain, len(prompt)),
                            "draft": lambda: DraftModelProposer(draft, 2048, 8)}[method]()
                found, ms, stats = generate(gpu, prompt, tokens, Speculator(config, proposer))
                same = next((i for i, (a, b) in enumerate(zip(found, plain)) if a != b), len(plain))
                results[f"spec_{method}_k{k}_{verify}"] = (
                    f"{ms:.3f} ms/token, {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} accepted, "
                    f"equal to plain for {same} of {len(plain)} tokens")


EAGLE3_DRAFT_VOCAB = 32000  # as published heads for Qwen3 have it


def eagle3_head_folder(folder: Path, weights: bool = True) -> Path:
    """A random EAGLE-3 head for the Qwen3-4B shape (weights of about 0.02, as the target's) in `folder`/head, or
    its config.json alone (what prepare_sweeps.sh compiles for)."""
    from pegainfer.fixtures.draft_heads import eagle3_config, make_eagle3_head
    from pegainfer.frontends.load import embedded_configs

    target = folder / "target"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(embedded_configs()[MODEL].read_text())
    if weights:
        return make_eagle3_head(target, folder / "head", draft_vocab=EAGLE3_DRAFT_VOCAB, std=0.02)
    (folder / "head").mkdir(exist_ok=True)
    config = eagle3_config(json.loads((target / "config.json").read_text()), draft_vocab=EAGLE3_DRAFT_VOCAB)
    (folder / "head" / "config.json").write_text(json.dumps(config, indent=1))
    return folder / "head"


def bench_eagle3(results: dict) -> None:
    """A random EAGLE-3 head (its drafts are noise: this measures the machinery's cost a token and that the
    output is exactly plain decoding's), K = 2..6, verify steps in CUDA graphs."""
    from pegainfer.runtime.bench import bench_model
    from pegainfer.runtime.drafter_graphs import with_drafter_features
    from pegainfer.runtime.speculative import parse_speculative_config

    head = eagle3_head_folder(Path("/tmp/eagle3"))
    configs = {k: parse_speculative_config({"method": "eagle3", "num_speculative_tokens": k, "model": str(head)})
               for k in range(2, 7)}
    model = with_drafter_features(configs[2], bench_model(MODEL))
    gpu = engine(model, max_batch=8, max_samples=8 * 7)
    measure_heads(results, "eagle3", gpu, model, configs, np.random.default_rng(1))


MTP_MODEL = "qwen3.5-4b"  # a hybrid target: rejected drafts rolled back through spare state rows


def bench_mtp(results: dict) -> None:
    """Qwen3.5-4B's MTP head, random (its drafts are noise: the machinery's cost, and exactness through the
    recurrent state's roll-back), K = 1..3, on a GPU engine beside the target's."""
    from pegainfer.frontends.load import LoadedModel
    from pegainfer.runtime.bench import bench_model
    from pegainfer.runtime.drafter_graphs import with_drafter_features
    from pegainfer.runtime.speculative import parse_speculative_config

    model = bench_model(MTP_MODEL)
    rng = np.random.default_rng(4)
    mtp = {name: (rng.standard_normal(t.shape) * 0.02).astype(t.dtype.np_dtype)
           for name, t in model.spec.dag.mtp_params(model.spec.config).items()}
    configs = {k: parse_speculative_config({"method": "mtp", "num_speculative_tokens": k}) for k in (1, 2, 3)}
    model = with_drafter_features(configs[1], LoadedModel(model.spec, model.folder, model.weights, mtp))
    gpu = engine(model, max_batch=8, max_samples=8 * 4, spare_states=8)
    measure_heads(results, "mtp", gpu, model, configs, rng)


def measure_heads(results: dict, label: str, gpu, model, configs: dict, rng) -> None:
    """ms a token at batch 1, greedy, 128 tokens after a random 384-token prompt, plainly and with each config's
    drafter (each run twice: the first captures its graphs), and how far its tokens equal the plain ones."""
    from pegainfer.runtime.proposers import make_speculator

    prompt, tokens = rng.integers(10, TOKENS, 384).tolist(), 128
    plain, ms, _ = generate(gpu, prompt, tokens)
    plain, ms, _ = generate(gpu, prompt, tokens)
    results[f"{label}_plain_ms_per_token"] = round(ms, 3)
    for k, config in configs.items():
        gpu.options.verify_tokens = k + 1
        speculator = make_speculator(config, model, "cuda", gpu.allocator.num_blocks * 16, 8, engine=gpu)
        generate(gpu, prompt, tokens, speculator)
        found, ms, stats = generate(gpu, prompt, tokens, speculator)
        same = next((i for i, (a, b) in enumerate(zip(found, plain)) if a != b), len(plain))
        results[f"{label}_k{k}"] = (f"{ms:.3f} ms/token, {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} "
                                    f"accepted, equal to plain for {same} of {len(plain)} tokens")

def bench_host(results: dict) -> None:
    from pegainfer.runtime.bench import bench_model
    from pegainfer.runtime.host_tier import HostTier
    from pegainfer.runtime.scheduler import SchedulerConfig

    model = bench_model(MODEL)
    rng = np.random.default_rng(2)
    for length in (1024, 4096, 16384):
        limit = length + 512
        config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=limit)
        gpu = engine(model, max_batch=4, max_model_len=limit, kv_tokens=limit)
        host = HostTier(gpu, limit // 16 + 8, gpu.options.block_size)
        sched = scheduler(gpu, config, host=host)
        shared = rng.integers(10, TOKENS, length).tolist()

        def ttft(prompt: list[int]) -> float:
            sched.add(request(str(time.monotonic()), prompt, 2))
            began, first = time.perf_counter(), None
            while sched.has_work():
                if sched.step() and first is None:
                    first = time.perf_counter() - began
            return first * 1e3
        ttft(rng.integers(10, TOKENS, 64).tolist())  # warm-up: graphs and first launches
        cold = ttft(shared + [5, 6])
        gpu_hit = ttft(shared + [7, 8])
        ttft(rng.integers(10, TOKENS, limit - 16).tolist())  # a filler of the pool's size evicts the prefix
        restored_before = host.restored
        warm = ttft(shared + [9, 10])
        results[f"host_{length}"] = (f"cold {cold:.1f} ms, GPU hit {gpu_hit:.1f} ms, host restore {warm:.1f} ms "
                                     f"({host.restored - restored_before} blocks, copies "
                                     f"{gpu.restore_seconds() * 1e3:.1f} ms in all)")


def main() -> None:
    if sys.argv[1:2] == ["head-config"]:
        print(eagle3_head_folder(Path(sys.argv[2]), weights=False))
        return
    wanted = sys.argv[1:] or ["lora", "spec", "eagle3", "host"]
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    file = out / "features_bench.json"
    results: dict = json.loads(file.read_text()) if file.exists() else {}
    for name in wanted:
        began = time.perf_counter()
        try:
            {"lora": bench_lora, "spec": bench_spec, "host": bench_host, "eagle3": bench_eagle3,
             "mtp": bench_mtp}[name](results)
        except Exception as error:  # noqa: BLE001  one part's failure is a row of the table, not the end
            results[f"{name}_error"] = f"{type(error).__name__}: {error}"
        print(f"{name}: {time.perf_counter() - began:.0f} s", flush=True)
        file.write_text(json.dumps(results, indent=1))
    for key, value in results.items():
        print(f"{key:28} {value}")


if __name__ == "__main__":
    main()
