"""LoRA adapters, n-gram speculation and the host KV tier on the GPU engine, on a small random Qwen3 (bf16): rows of an
adapter and of the base model batched in one engine (prefill, then decode through CUDA graphs) against the CPU
engine, and teacher-forced against PEFT in bf16 on the card (the golden gate's statistics); greedy decoding with
n-gram drafts verified in eager steps and in CUDA graphs, and with a draft model equal to the target on a GPU engine
of its own, against decoding without them; a prefix evicted from a small KV pool and restored from pinned host blocks
against a cold run. Prints a table last; every number also goes to $OUT/features.json.

On this (CPU) machine, once:  .venv/bin/python scripts/gpu/features_check.py prepare
  (the checkpoint in .gpu/feat_small, a PEFT adapter in .gpu/feat_adapter, the base and LoRA manifests in
  .gpu/cache_feat: all git-ignored)
On the GPU machine, carrying [".gpu/feat_small", ".gpu/feat_adapter", ".gpu/cache_feat"]:
  . scripts/gpu/env.sh && PEGAINFER_CACHE=$PWD/.gpu/cache_feat python3 scripts/gpu/features_check.py run
"""

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

SMALL, ADAPTER, CACHE = Path(".gpu/feat_small"), Path(".gpu/feat_adapter"), Path(".gpu/cache_feat")
SHAPE = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000}
LORA = (2, 16)  # slots, rank


def prepare(python: str) -> None:
    def run(*args: str) -> None:
        print("+", " ".join(args), flush=True)
        subprocess.run(args, check=True)
    sets = [f"--set={key}={value}" for key, value in SHAPE.items()]
    run(python, "-m", "pegainfer.cli", "make-checkpoint", str(SMALL), "--dtype", "bfloat16", "--seed", "3",
        "--logit-std", "2", *sets)  # the gate's bounds hold at spread 2 (check.py's gate_4b); 6 fails by construction
    make_adapter()
    for extra in ([], ["--enable-lora", "--max-loras", str(LORA[0]), "--max-lora-rank", str(LORA[1])]):
        run(python, "-m", "pegainfer.cli", "compile", str(SMALL), "--sm", "90", "--backends", "triton",
            "--cache-dir", str(CACHE), *extra)


def make_adapter() -> None:
    """A PEFT adapter of rank 16 on every projection, A and B random (PEFT starts B at zero)."""
    here = Path(__file__).parent.resolve()  # its kernels.py would shadow the package transformers imports
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(SMALL, dtype=torch.float32)
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=LORA[1], lora_alpha=2 * LORA[1], target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    generator = torch.Generator().manual_seed(7)
    for name, param in tuned.named_parameters():
        if "lora_" in name:
            param.data = torch.randn(param.shape, generator=generator) * (0.3 / np.sqrt(param.shape[-1]))
    tuned.save_pretrained(ADAPTER)


def serve(engine, work: list, lora=None, speculator=None, overlap: bool = True) -> tuple[dict, object]:
    from pegainfer.runtime.requests import EngineRequest
    from pegainfer.runtime.sampler import SamplingParams
    from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512,
                                                               max_model_len=512, prefix_cache=False,
                                                               async_scheduling=overlap), speculator, lora)
    for i, (prompt, adapter) in enumerate(work):
        scheduler.add(EngineRequest(str(i), prompt, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3),
                                    lora=adapter))
    out: dict[str, list] = {str(i): [] for i in range(len(work))}
    while scheduler.has_work():
        for token in scheduler.step():
            out[token.request_id].append((token.token_id, token.logprobs))
    return out, scheduler.stats


def compare(found: dict, expected: dict) -> dict:
    """First disagreeing token of each request (its length where none), and the largest logprob gap before."""
    first, gap = [], 0.0
    for key, tokens in expected.items():
        ours = found[key]
        agree = next((i for i, (a, b) in enumerate(zip(ours, tokens)) if a[0] != b[0]), len(tokens))
        first.append(agree)
        for (_, mine), (_, theirs) in zip(ours[:agree], tokens[:agree]):
            gap = max(gap, max(abs(mine[t] - theirs[t]) for t in mine.keys() & theirs.keys()))
    return {"first_disagreement": first, "max_logprob_gap": round(gap, 4)}


def check_lora(results: dict) -> None:
    from pegainfer.frontends.load import load_model
    from pegainfer.frontends.lora import LoraConfig, lora_model, read_adapter
    from pegainfer.runtime.gpu.engine import EngineOptions
    from pegainfer.runtime.gpu.start import gpu_engine
    from pegainfer.runtime.lora import LoraSlots
    from pegainfer.runtime.reference_engine import ReferenceEngine

    model = load_model(SMALL, lazy=True, device="cuda")
    config = LoraConfig(*LORA)
    tuned = lora_model(model, config)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 900, 40).tolist()
    work = [(shared, "a"), (rng.integers(3, 900, 17).tolist(), None), (rng.integers(3, 900, 29).tolist(), "a"),
            (shared, None)]
    engines = {"gpu": gpu_engine(tuned, EngineOptions(max_tokens=512, max_batch=8, max_model_len=512,
                                                      kv_tokens=8192)),
               "cpu": ReferenceEngine(replace(tuned, weights=load_model(SMALL).weights), max_tokens=8192,
                                      graph=tuned.spec.graph)}
    outputs = {}
    for name, engine in engines.items():
        slots = LoraSlots(engine.graph, config, engine.write_lora)
        slots.register(read_adapter("a", ADAPTER, engine.graph, config))
        outputs[name], _ = serve(engine, work, slots)
    results["lora_gpu_vs_cpu"] = compare(outputs["gpu"], outputs["cpu"])
    results["lora_changes_the_output_ok"] = outputs["gpu"]["0"] != outputs["gpu"]["3"]  # one prompt, with and without


def check_lora_gate(results: dict) -> None:
    """PEFT in bf16 on this card (the adapter unmerged, and disabled for the base rows) against the GPU engine
    with the adapter in slot 0, its rows batched with base rows, teacher-forced on PEFT's greedy tokens (check.py's
    statistics); beside it, PEFT in bf16 and ours against PEFT in float32 on the same tokens: the bf16 rounding's
    own share."""
    import torch
    import transformers
    from peft import PeftModel

    from pegainfer.frontends.load import load_model
    from pegainfer.frontends.lora import LoraConfig, adapter_rows, lora_model, read_adapter
    from pegainfer.runtime.gpu.engine import EngineOptions
    from pegainfer.runtime.gpu.start import gpu_engine

    check = gpu_check()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 900, n).tolist() for n in (23, 31, 17, 40)]
    tuned_hf = {dtype: PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
        SMALL, dtype=dtype).cuda().eval(), ADAPTER).eval() for dtype in (torch.bfloat16, torch.float32)}
    adapted, adapted_rows = check.hf_greedy(tuned_hf[torch.bfloat16], prompts, 16)
    with tuned_hf[torch.bfloat16].disable_adapter():
        based, based_rows = check.hf_greedy(tuned_hf[torch.bfloat16], prompts, 16)
    model = load_model(SMALL, lazy=True, device="cuda")
    config = LoraConfig(*LORA)
    tuned = lora_model(model, config)
    engine = gpu_engine(tuned, EngineOptions(max_tokens=512, max_batch=8, max_model_len=512, kv_tokens=8192))
    engine.write_lora(0, adapter_rows(read_adapter("a", ADAPTER, engine.graph, config), engine.graph))
    ours = check.teacher_forced(engine, prompts * 2, adapted + based, [0] * len(prompts) + [-1] * len(prompts))
    results["lora_gate_adapter_rows"] = check.gate_stats(adapted_rows, ours[:len(prompts)])
    results["lora_gate_base_rows"] = check.gate_stats(based_rows, ours[len(prompts):])
    alone = check.teacher_forced(engine, prompts, based)  # no adapter row: the graphs without the updates
    results["lora_gate_base_alone"] = check.gate_stats(based_rows, alone)
    results["lora_graphs"] = sorted(map(str, engine.graphs))
    float32_rows = forced_rows(tuned_hf[torch.float32], prompts, adapted)
    results["lora_gate_noise_peft_bf16_vs_float32"] = check.gate_stats(float32_rows, adapted_rows)
    results["lora_gate_noise_ours_vs_float32"] = check.gate_stats(float32_rows, ours[:len(prompts)])
    results["lora_gate_ok"] = all(  # ../shared/DESIGN.md's bounds: regret max, mean and p99 |delta logprob|
        stats["argmax_regret_max"] <= 0.2 and stats["mean_abs_dlogprob_top8"] <= 0.06 and
        stats["p99_abs_dlogprob_top8"] <= 0.2 for key, stats in results.items()
        if key.startswith("lora_gate_") and not key.startswith("lora_gate_noise_"))


def gpu_check():
    """scripts/gpu/check.py as a module, without putting its folder on sys.path (its kernels.py would shadow)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).with_name("check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def forced_rows(model, prompts: list[list[int]], continuations: list[list[int]]) -> list[np.ndarray]:
    """A Hugging Face model's logits rows from each prompt's last token on, over the given continuation."""
    import torch

    with torch.no_grad():
        return [model(torch.tensor([p + c]).cuda()).logits[0, len(p) - 1:].float().cpu().numpy()
                for p, c in zip(prompts, continuations)]


def check_speculation(results: dict) -> None:
    from pegainfer.frontends.load import load_model
    from pegainfer.runtime.gpu.engine import EngineOptions
    from pegainfer.runtime.gpu.start import gpu_engine
    from pegainfer.runtime.proposers import DraftModelProposer, NgramProposer
    from pegainfer.runtime.speculative import Speculator, parse_speculative_config

    model = load_model(SMALL, lazy=True, device="cuda")
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    rng = np.random.default_rng(1)
    pattern = rng.integers(3, 900, 12).tolist()
    work = [(pattern * 4, None), (rng.integers(3, 900, 30).tolist(), None), (pattern[:5] * 6, None)]
    options = EngineOptions(max_tokens=512, max_batch=8, max_model_len=512, kv_tokens=8192, max_samples=8 * 5)
    plain, _ = serve(gpu_engine(model, options), work, overlap=False)  # plain steps, as speculation's
    results["async_gpu_vs_plain_gpu"] = compare(serve(gpu_engine(model, options), work)[0], plain)
    for verify, width in (("eager", 0), ("graphs", 5)):
        engine = gpu_engine(model, replace(options, verify_tokens=width))
        drafted, stats = serve(engine, work, speculator=Speculator(config, NgramProposer(config)))
        results[f"ngram_{verify}_gpu_vs_plain_gpu"] = compare(drafted, plain)
        results[f"ngram_{verify}_drafts_accepted"] = f"{stats.spec_accepted_tokens} of {stats.spec_draft_tokens}"
        results[f"ngram_{verify}_graphs"] = sorted(engine.graphs)
    draft = gpu_engine(model, options)  # a draft model equal to the target: every draft accepted
    config = parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 4, "model": str(SMALL)})
    proposer = DraftModelProposer(draft, draft.options.max_tokens, draft.options.max_batch)
    drafted, stats = serve(gpu_engine(model, replace(options, verify_tokens=5)), work,
                           speculator=Speculator(config, proposer))
    results["draft_model_gpu_vs_plain_gpu"] = compare(drafted, plain)
    results["draft_model_drafts_accepted"] = f"{stats.spec_accepted_tokens} of {stats.spec_draft_tokens}"


def check_host_tier(results: dict) -> None:
    from pegainfer.frontends.load import load_model
    from pegainfer.runtime.gpu.engine import EngineOptions
    from pegainfer.runtime.gpu.start import gpu_engine
    from pegainfer.runtime.host_tier import HostTier
    from pegainfer.runtime.requests import EngineRequest
    from pegainfer.runtime.sampler import SamplingParams
    from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

    model = load_model(SMALL, lazy=True, device="cuda")
    rng = np.random.default_rng(2)
    shared, filler = rng.integers(3, 900, 256).tolist(), rng.integers(3, 900, 300).tolist()

    def run_all(kv_tokens: int, host_blocks: int) -> tuple[list, object]:
        engine = gpu_engine(model, EngineOptions(max_tokens=512, max_batch=4, max_model_len=384, kv_tokens=kv_tokens))
        host = HostTier(engine, host_blocks, engine.options.block_size) if host_blocks else None
        scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                                                   max_model_len=384), host=host)
        found = []
        for i, prompt in enumerate((shared + [5, 6], filler, shared + [7, 8])):  # the filler evicts the prefix
            scheduler.add(EngineRequest(str(i), prompt, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3)))
            tokens = []
            while scheduler.has_work():
                tokens += [(t.token_id, t.logprobs) for t in scheduler.step()]
            found.append(tokens)
        return found, host
    warm, host = run_all(kv_tokens=24 * 16, host_blocks=64)
    cold, _ = run_all(kv_tokens=8192, host_blocks=0)
    results["host_tier_vs_cold"] = compare({"2": warm[2]}, {"2": cold[2]})
    results["host_tier_blocks"] = f"{host.offloaded} copied down, {host.restored} restored"


def run(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for name, check in (("lora", check_lora), ("lora_gate", check_lora_gate), ("speculation", check_speculation),
                        ("host_tier", check_host_tier)):
        try:
            check(results)
        except Exception as error:  # noqa: BLE001  one check's failure is a row of the table, not the end
            results[f"{name}_error"] = f"{type(error).__name__}: {error}"
    (out / "features.json").write_text(json.dumps(results, indent=1, default=str))
    for key, value in results.items():
        print(f"{key:32} {value}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["prepare", "run"])
    args = parser.parse_args()
    if args.what == "prepare":
        prepare(sys.executable)
    else:
        run(Path(os.environ.get("OUT", "/tmp/out")))


if __name__ == "__main__":
    main()
