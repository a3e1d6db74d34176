"""On the GPU: the golden gate of FP8 weights at the full Qwen3-4B shape, in both formats. Hugging Face's random init
(bf16, logits spread 2, as check.py's gate_4b), its projections quantized as we take them (`--quantization fp8`: a
scale per output channel; an FP8 checkpoint's 128 x 128 blocks) and handed to our engine; Hugging Face runs the
same projections dequantized (W8A16), then again with each projection's input rounded as our W8A8 tiles round the
rows (groups of 128 columns to e4m3: ir/ops/quantize.py quantize_row_groups). Per case, the gate's statistics of
ours against W8A16, of the emulated W8A8 against W8A16 (what the activations' rounding alone costs) and of ours
against the emulation, all on W8A16's greedy tokens.

    carry [".gpu/src", ".gpu/cache_qwen3_fp8"] (after scripts/gpu/prepare_sweeps.sh here), source env.sh, then
    PYTHONPATH=$PYTHONPATH:scripts/gpu PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3_fp8 python3 scripts/gpu/fp8_gate.py \
        --out $OUT/fp8_gate"""

import argparse
import json
from pathlib import Path

import numpy as np
from check import gate_stats, hf_greedy, hf_weights, manifest_4b, random_hf_4b, teacher_forced

from pegainfer.fixtures.checkpoint import fp8_block_weights
from pegainfer.frontends.load import LoadedModel, load_spec, resolve_config_path
from pegainfer.frontends.online_quantization import quantize_rows
from pegainfer.ir.dtypes import BF16, F8E4M3
from pegainfer.ir.ops.quantize import ROW_GROUP, dequantize
from pegainfer.runtime import bench

FORMATS = {"channel": ("qwen3-4b", "fp8", None, "_scale"), "block": ("qwen3-4b-fp8", None, (128, 128), "_scale_inv")}


def quantize_blocks(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 values, float32 scales) of a bf16 weight in blocks, as make-checkpoint writes an FP8 checkpoint's."""
    import torch

    values, scale = fp8_block_weights(torch.from_numpy(np.ascontiguousarray(weight).view(np.int16))
                                      .view(torch.bfloat16), torch, block)
    return values.view(torch.uint8).numpy().view(F8E4M3.np_dtype), scale.numpy()


def quantized_model(config: str, quantization: str | None, block, suffix: str, source: dict) -> tuple:
    """Our FP8 model over the bf16 `source` weights, and each projection as its FP8 form stands for (bf16)."""
    spec = load_spec(resolve_config_path(config), device="cuda", quantization=quantization)
    weights, dequantized = {}, {}
    for name, t in spec.graph.checkpoint_params().items():
        if name.endswith(suffix) and name.removesuffix(suffix) in source:
            continue
        if t.dtype != F8E4M3:
            weights[name] = source[name]
            continue
        values, scale = quantize_rows(source[name]) if block is None else quantize_blocks(source[name], block)
        weights[name], weights[name + suffix] = values, scale
        dequantized[name] = dequantize(values, scale, block=block or (1, values.shape[1]), dtype=BF16.name)
    return LoadedModel(spec, Path(config), weights), dequantized


def load_into(hf, tensors: dict[str, np.ndarray]) -> None:
    """Copies bf16 host arrays over the Hugging Face parameters of the same names."""
    import torch

    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, array in tensors.items():
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16))


def w8a8_hooks(hf, names: list[str], on: list[bool]) -> list:
    """Pre-hooks on the projections named (their weights' names) that round each input as the W8A8 tiles do, while
    on[0]: each row's groups of ROW_GROUP columns over their largest magnitude / 448, to e4m3 and back; their
    handles."""
    import torch

    def round_rows(module, args):
        if not on[0]:
            return None
        x = args[0]
        groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // ROW_GROUP, ROW_GROUP)
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10) / 448.0
        return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape).to(x.dtype),
    modules = dict(hf.named_modules())
    return [modules[name.removesuffix(".weight")].register_forward_pre_hook(round_rows) for name in names]


def hf_forced(hf, prompts: list[list[int]], continuations: list[list[int]]) -> list[np.ndarray]:
    """Hugging Face's logits rows from each prompt's last token on, over the given continuation."""
    import torch

    rows = []
    with torch.no_grad():
        for prompt, continuation in zip(prompts, continuations):
            logits = hf(torch.tensor([[*prompt, *continuation]]).cuda()).logits[0].float().cpu().numpy()
            rows.append(logits[len(prompt) - 1:])
    return rows


def gate_cases(hf, engine, emulate: list[bool], vocab: int) -> dict:
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (7, 30, 1, 61)]
    cases = {"batch4": (prompts, 16), "batch1": (prompts[:1], 16),
             **{f"graph_batch{size}": ([rng.integers(0, vocab, int(rng.integers(1, 24))).tolist()
                                        for _ in range(size)], 4) for size in (9, 17, 33, 65)}}
    out = {}
    for case, (ps, steps) in cases.items():
        emulate[0] = False
        continuations, w8a16 = hf_greedy(hf, ps, steps)
        ours = teacher_forced(engine, ps, continuations)
        emulate[0] = True
        emulated = hf_forced(hf, ps, continuations)
        emulate[0] = False
        out[case] = {"ours_vs_w8a16": gate_stats(w8a16, ours), "w8a8_emulated_vs_w8a16": gate_stats(w8a16, emulated),
                     "ours_vs_w8a8_emulated": gate_stats(emulated, ours)}
        print(case, json.dumps(out[case]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    hf, spread = random_hf_4b(2.0)
    source = hf_weights(hf, set(hf.state_dict()))
    results = {"logits_std_before_scaling": spread}
    for form in args.formats:
        model, dequantized = quantized_model(*FORMATS[form], source)
        load_into(hf, dequantized)
        emulate = [False]
        hooks = w8a8_hooks(hf, sorted(dequantized), emulate)
        engine = bench.engine_for(model, manifest_4b(model), max_tokens=4096, max_batch=72, max_model_len=512)
        results[form] = gate_cases(hf, engine, emulate, hf.config.vocab_size)
        (args.out / "fp8_gate.json").write_text(json.dumps(results, indent=1))
        del engine
        for hook in hooks:  # the next format starts from the same bf16 weights, with no hooks
            hook.remove()
        load_into(hf, {name: source[name] for name in dequantized})
    print(f"{'format':<8} {'case':<14} {'ours vs W8A16':>26} {'W8A8 emulated vs W8A16':>26} {'ours vs emulated':>26}")
    for form in args.formats:
        for case, r in results[form].items():
            cells = [f"{g['argmax_regret_max']:.3f} {g['mean_abs_dlogprob_top8']:.4f} {g['p99_abs_dlogprob_top8']:.3f}"
                     for g in r.values()]
            print(f"{form:<8} {case:<14} " + " ".join(f"{c:>26}" for c in cells))


if __name__ == "__main__":
    main()
