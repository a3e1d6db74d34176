"""FP8 checkpoints as Qwen's own `Qwen3-*-FP8` store them (quant_method fp8: e4m3 weights, a float32
`weight_scale_inv` per 128 x 128 block) and as llm-compressor's FP8_DYNAMIC does (compressed-tensors, a
`weight_scale` per output channel), written by `make-checkpoint --quantization fp8-block|fp8-channel` with real
scales, and by `--quantization fp8` at load: the reference engine's logits equal Hugging Face float32 on the
dequantized weights, prefill and 16 decode steps; the dequantize op's blocks cut short at a weight's edge; a bad
scale, format, option or flag is one line naming it, as is FP8 for an SM without FP8 conversions."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.fixtures.checkpoint import fp8_block_weights, fp8_channel_weights
from pegainfer.frontends.quantization import FP8_MAX
from pegainfer.frontends.load import load_model
from pegainfer.ir.ops.quantize import dequantize
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.reference_engine import ReferenceEngine

# gate/up are 200 x 64 and down 64 x 200: blocks cut short by the weights' edges on both axes
OVERRIDES = {"intermediate_size": 200, "num_hidden_layers": 2}
PROMPTS = ([3, 17, 40, 5, 99], [7], list(range(20, 53)))
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoint_factory):
    return checkpoint_factory("fp8-block", OVERRIDES, quantization="fp8-block")


@pytest.fixture(scope="module", params=["fp8-block", "fp8-channel"])
def either_format(request, checkpoint_factory):
    return checkpoint_factory(request.param, OVERRIDES, quantization=request.param)


def as_numpy_fp8(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


def hf_on_dequantized(folder) -> torch.nn.Module:
    """Hugging Face float32 with each FP8 weight times its block's scale, as the checkpoint means it."""
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"}),
        attn_implementation="eager", dtype=torch.float32).eval()
    stored = load_file(folder / "model.safetensors")
    state = {name: tensor.float() for name, tensor in stored.items()
             if not name.endswith(("_scale", "_scale_inv")) and tensor.dtype != torch.float8_e4m3fn}
    for name, tensor in stored.items():
        if tensor.dtype != torch.float8_e4m3fn:
            continue
        if f"{name}_scale" in stored:  # dequantized here by torch, apart from the op under test
            state[name] = tensor.float() * stored[f"{name}_scale"].float()
        else:
            scale = stored[f"{name}_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            state[name] = tensor.float() * scale[: tensor.shape[0], : tensor.shape[1]]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(model.config.tie_word_embeddings and "lm_head" in m for m in missing)
    return model


@pytest.mark.parametrize("lowered", [False, True], ids=["declared", "lowered"])
def test_an_fp8_checkpoint_runs_as_hugging_face_does_on_its_dequantized_weights(either_format, lowered):
    """Both formats; the graph as declared and the kernel DAG the pass pipeline makes of it (its dequantize nodes
    kept apart)."""
    ours = load_model(either_format)
    up_scale = next(n for n in ours.weights if n.startswith("model.layers.0.mlp.up_proj.weight_scale"))
    assert ours.weights["model.layers.0.mlp.up_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert ours.weights[up_scale].shape == ((2, 1) if up_scale.endswith("_inv") else (200, 1))
    assert "lm_head.weight" not in ours.weights or ours.weights["lm_head.weight"].dtype == np.float32
    theirs = hf_on_dequantized(either_format)
    engine = ReferenceEngine(ours, max_tokens=256, graph=lower(ours.spec.graph)[0] if lowered else None)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(PROMPTS)]
    prefill = engine.step([Chunk(s, len(s.token_ids)) for s in seqs], all_logits=True)
    with torch.no_grad():
        expected = np.concatenate([theirs(torch.tensor([p])).logits[0].numpy() for p in PROMPTS])
    assert np.abs(prefill - expected).max() / np.abs(expected).max() < 1e-4
    logits = prefill[np.cumsum([len(p) for p in PROMPTS]) - 1]
    for step in range(DECODE_STEPS):
        for seq, token in zip(seqs, logits.argmax(-1)):
            seq.token_ids.append(int(token))
        with torch.no_grad():
            expected = np.stack([theirs(torch.tensor([s.token_ids])).logits[0, -1].numpy() for s in seqs])
        logits = engine.step([Chunk(s, 1) for s in seqs])
        assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4, f"decode step {step}"


def test_blocks_are_cut_short_at_the_weights_edge_and_each_block_keeps_its_largest_value():
    weight = torch.randn(200, 300) * torch.linspace(0.1, 5, 300)
    values, scale = fp8_block_weights(weight, torch)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    back = dequantize(as_numpy_fp8(values), scale.numpy(), block=(128, 128), dtype="float32")
    assert back.shape == (200, 300) and np.abs(back - weight.numpy()).max() <= np.abs(weight.numpy()).max() / 16
    assert np.isclose(np.abs(values.float().numpy()[128:, 256:]).max(), FP8_MAX)  # the corner block, 72 x 44


def rewrite(folder, out, config_edit=None, tensor_edit=None):
    """A copy of the checkpoint in `out` with its config.json or tensors edited."""
    out.mkdir()
    for file in folder.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    if config_edit:
        config = json.loads((out / "config.json").read_text())
        config_edit(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    if tensor_edit:
        tensors = load_file(out / "model.safetensors")
        tensor_edit(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("edit,message", [
    (lambda q: q.update(quant_method="awq"), "quantization_config.quant_method 'awq' is not implemented"),
    (lambda q: q.update(fmt="e5m2"), "quantization_config.fmt 'e5m2' is not implemented"),
    (lambda q: q.update(activation_scheme="static"), "quantization_config.activation_scheme 'static'"),
    (lambda q: q.pop("weight_block_size"), "quantization_config.weight_block_size is missing"),
    (lambda q: q.update(weight_block_size=[128]), "weight_block_size must be two positive integers"),
    (lambda q: q.update(kv_cache_scheme="fp8"), "quantization_config.kv_cache_scheme is not implemented"),
])
def test_a_format_or_option_not_implemented_is_refused_naming_its_key(fp8_checkpoint, tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_model(rewrite(fp8_checkpoint, tmp_path / "edited", config_edit=edit))


@pytest.mark.parametrize("edit,message", [
    (lambda q: q.update(format="pack-quantized"), "quantization_config.format 'pack-quantized' is not implemented"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor"),
     "quantization_config.config_groups.group_0.weights.strategy 'tensor' is not implemented"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "int"}),
     "quantization_config.kv_cache_scheme.type 'int' is not implemented"),
    (lambda q: q.update(transform_config={}), "quantization_config.transform_config is not implemented"),
])
def test_a_compressed_tensors_scheme_other_than_fp8_dynamic_is_refused_naming_its_key(checkpoint_factory, tmp_path,
                                                                                      edit, message):
    folder = checkpoint_factory("fp8-channel", OVERRIDES, quantization="fp8-channel")
    with pytest.raises(ConfigError, match=message):
        load_model(rewrite(folder, tmp_path / "edited", config_edit=edit))


def test_a_scale_of_the_wrong_shape_or_a_weight_not_in_fp8_is_one_line_naming_the_tensor(fp8_checkpoint, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"

    def bad_scale(tensors):
        tensors[name + "_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}_scale_inv' has shape \[1, 1\], expected \[1, 2\]"):
        load_model(rewrite(fp8_checkpoint, tmp_path / "scale", tensor_edit=bad_scale))

    def not_fp8(tensors):
        tensors[name] = tensors[name].float().to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype BF16, expected f8e4m3"):
        load_model(rewrite(fp8_checkpoint, tmp_path / "dtype", tensor_edit=not_fp8))


def test_fp8_weights_for_an_sm_without_fp8_conversions_are_refused_in_one_line(fp8_checkpoint, tmp_path):
    run = subprocess.run([sys.executable, "-m", "pegainfer.cli", "compile", str(fp8_checkpoint), "--sm", "80",
                          "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == (
        "pegainfer: error: FP8 weights need sm_89 or newer (FP8 conversions); found sm_80: run the bf16 "
        "checkpoint there, or this one with --device cpu")


def test_quantized_at_load_runs_as_hugging_face_does_on_the_same_fp8_weights(checkpoint_factory):
    """`--quantization fp8` on a float32 checkpoint: a scale per output channel computed at load; the logits are
    Hugging Face float32's on weights quantized the same way by torch (fixtures' fp8_channel_weights), not the
    unquantized model's (FP8's three mantissa bits move this random model's logits by about a tenth of their
    range)."""
    folder = checkpoint_factory("fp8_source", OVERRIDES)
    ours = load_model(folder, quantization="fp8")
    assert ours.weights["model.layers.1.mlp.down_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert ours.weights["model.layers.1.mlp.down_proj.weight_scale"].shape == (64, 1)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in theirs.modules():
            if isinstance(module, torch.nn.Linear) and module is not theirs.get_output_embeddings():
                values, scale = fp8_channel_weights(module.weight, torch)
                module.weight.copy_(values.float() * scale)
        expected = theirs(torch.tensor([PROMPTS[2]])).logits[0].numpy()
        unquantized = plain(torch.tensor([PROMPTS[2]])).logits[0].numpy()
    got = ReferenceEngine(ours, max_tokens=64).step([Chunk(Sequence(0, list(PROMPTS[2])), len(PROMPTS[2]))],
                                                    all_logits=True)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-4
    assert np.abs(got - unquantized).max() / np.abs(unquantized).max() > 1e-2


def test_quantized_at_load_lazily_gives_the_eager_tensors_one_at_a_time(checkpoint_factory):
    """The GPU's way (lazy): each projection quantized when it or its scale is first read, the same bytes as the
    eager load's; the tensors left as stored keep their file spans, so the uploader reads them straight."""
    from pegainfer.frontends.online_quantization import QuantizedWeights

    folder = checkpoint_factory("fp8_source", OVERRIDES)
    eager, lazy = (load_model(folder, quantization="fp8", lazy=flag).weights for flag in (False, True))
    assert isinstance(lazy, QuantizedWeights) and sorted(lazy) == sorted(eager)
    name = "model.layers.1.self_attn.o_proj.weight"
    scale = lazy[name + "_scale"]  # the scale first: the values wait for their turn
    assert np.array_equal(lazy[name].view(np.uint8), eager[name].view(np.uint8))
    assert np.array_equal(scale, eager[name + "_scale"]) and not lazy._pending
    assert all(np.array_equal(np.asarray(lazy[n]).view(np.uint8), np.asarray(eager[n]).view(np.uint8)) for n in eager)
    assert lazy.span(name) is None and lazy.span("model.norm.weight") is not None


def test_quantization_flags_are_checked_in_one_line(fp8_checkpoint, checkpoint_factory):
    with pytest.raises(ConfigError, match="--quantization fp8: .* is quantized already"):
        load_model(fp8_checkpoint, quantization="fp8")
    with pytest.raises(ConfigError, match="--quantization int4: expected one of fp8"):
        load_model(checkpoint_factory("fp8_source", OVERRIDES), quantization="int4")
    run = subprocess.run([sys.executable, "-m", "pegainfer.cli", "generate", "--model-path",
                          str(checkpoint_factory("fp8_source", OVERRIDES)), "--quantization", "fp8", "--device",
                          "cpu", "--prompt-ids", "5,9,200", "--max-tokens", "4", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["token_ids"]) == 4


def test_fp8_models_get_their_own_manifests_and_show_fp8_operands(checkpoint_factory):
    """The compiled-kernel cache names a model by its config and its FP8 weights: the same config as bf16, with
    block scales and with channel scales, are three manifests (their GEMMs are different cubins)."""
    from pegainfer.backends.cache import model_id
    from pegainfer.frontends.load import load_spec
    from pegainfer.passes.kernels import format_kernels

    source = checkpoint_factory("fp8_source", OVERRIDES) / "config.json"
    specs = [load_spec(source), load_spec(source, quantization="fp8"),
             load_spec(checkpoint_factory("fp8-block", OVERRIDES, quantization="fp8-block") / "config.json")]
    assert len({model_id(spec) for spec in specs}) == 3
    table = format_kernels(lower(specs[1].graph)[0])
    assert "dequantize+linear (f8e4m3, f32" in table and "dequantize " not in table


def test_quantizing_at_load_in_blocks_of_rows_on_threads_equals_the_whole_weight_at_once():
    """quantize_rows' threads each take ROWS_PER_TASK rows: the values and scales are the formula's over the whole
    weight, bit for bit, an all-zero row's scale 1 and a last block short."""
    import ml_dtypes

    from pegainfer.frontends.online_quantization import ROWS_PER_TASK, quantize_rows
    from pegainfer.frontends.quantization import FP8_MAX
    from pegainfer.ir.dtypes import F8E4M3

    rng = np.random.default_rng(3)
    weight = (rng.standard_normal((2 * ROWS_PER_TASK + 37, 96)) * 0.05).astype(ml_dtypes.bfloat16)
    weight[ROWS_PER_TASK + 1] = 0
    whole = weight.astype(np.float32)
    scale = np.abs(whole).max(axis=1, keepdims=True) / np.float32(FP8_MAX)
    scale[scale == 0] = 1
    values, scales = quantize_rows(weight, workers=3)
    assert np.array_equal(scales, scale) and scales[ROWS_PER_TASK + 1, 0] == 1
    assert np.array_equal(values.view(np.uint8), (whole / scale).astype(F8E4M3.np_dtype).view(np.uint8))


def test_rounding_to_e4m3_in_integer_ops_equals_the_ml_dtypes_cast_at_every_tie_and_beside_it():
    """round_to_e4m3 (GIL-free NumPy ops) against ml_dtypes' cast: every e4m3 value, every midpoint between two
    (ties to even) and the float32 on either side of it, both signs, subnormals and zeros, and a spread of values."""
    import ml_dtypes

    from pegainfer.frontends.online_quantization import round_to_e4m3, widen

    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(codes[np.isfinite(codes)])
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    spread = np.random.default_rng(4).standard_normal(20000).astype(np.float32) * np.float32(60)
    x = np.concatenate([grid, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                        np.clip(spread, -448, 448), np.float32([0.0, -0.0, 2.0 ** -12])])
    assert np.array_equal(round_to_e4m3(x).view(np.uint8), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    block = spread.reshape(100, 200).astype(ml_dtypes.bfloat16)
    assert np.array_equal(widen(block), block.astype(np.float32)) and widen(spread) is not spread
