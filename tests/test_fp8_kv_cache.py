"""`--kv-cache-dtype fp8`: the KV cache as float8 e4m3 with a scale per layer for keys and values. The CPU engine's
greedy tokens against a bf16 cache (the difference stated); the passes keep the reference exact; the Triton rope/KV
write and attention kernels under the interpreter against the reference; a checkpoint's k_scale / v_scale read and
applied; half the bytes a token; bad scales, dtypes and SMs refused in one line."""

import json
import subprocess
import sys

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pegainfer.backends.planning import PlanOptions
from pegainfer.backends.triton.execute import InterpretedExecutor, launch_kernel, to_numpy, to_torch
from pegainfer.backends.triton.plan import plan_kernel
from pegainfer.errors import CheckpointError, ConfigError
from pegainfer.frontends.config import normalize_hf_config, parse_config
from pegainfer.frontends.kv_cache import apply_kv_cache_dtype
from pegainfer.frontends.load import load_model, load_spec
from pegainfer.frontends.registry import dag_modules
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.interpreter import run_graph
from pegainfer.ir.registry import get_op
from pegainfer.ir.step import launch_sizes
from pegainfer.models import qwen3
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.reference_engine import ReferenceEngine

PROMPTS = ([3, 17, 40, 5, 99], [7], list(range(20, 53)))
DECODE_STEPS = 32
LAYERS = 2


@pytest.fixture(scope="module")
def folder(checkpoint_factory):
    return checkpoint_factory("kv_fp8", {"num_hidden_layers": LAYERS})


def greedy(engine: ReferenceEngine, steps: int = DECODE_STEPS) -> list[list[int]]:
    seqs = [Sequence(i, list(p)) for i, p in enumerate(PROMPTS)]
    logits = engine.step([Chunk(s, len(s.token_ids)) for s in seqs])
    for _ in range(steps):
        for seq, token in zip(seqs, logits.argmax(-1)):
            seq.token_ids.append(int(token))
        logits = engine.step([Chunk(s, 1) for s in seqs])
    return [s.token_ids for s in seqs]


def forced_logits(model, tokens: list[list[int]]) -> np.ndarray:
    """Every position's logits over the given token sequences, one prefill each."""
    engine = ReferenceEngine(model, max_tokens=512)
    return np.concatenate([engine.step([Chunk(Sequence(i, list(t)), len(t))], all_logits=True)
                           for i, t in enumerate(tokens)])


def difference(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(max relative error, share of positions whose argmax agrees)."""
    return (float(np.abs(ours - theirs).max() / np.abs(theirs).max()),
            float((ours.argmax(-1) == theirs.argmax(-1)).mean()))


def test_fp8_cache_against_a_bf16_one_on_the_cpu_engine(folder):
    """The bf16 model's greedy tokens (3 prompts, 32 steps), scored by the same model with an FP8 cache: measured
    0.096 max relative logit error and 87% of argmaxes agreeing, where bf16 against float32 is 0.024 and 95% (e4m3
    keeps 3 mantissa bits to bf16's 7); the FP8 engine's own greedy tokens first differ at generated tokens 9, 4
    and 8 of this sharpened random model."""
    bf16, fp8 = (load_model(folder, dtype="bfloat16", kv_cache_dtype=kv) for kv in ("auto", "fp8"))
    assert {t.dtype.name for t in fp8.spec.graph.expanded_states().values()} == {"f8e4m3"}
    tokens = greedy(ReferenceEngine(bf16, max_tokens=512))
    reference = forced_logits(load_model(folder, dtype="float32"), tokens)
    error_bf16, agree_bf16 = difference(forced_logits(bf16, tokens), reference)
    error_fp8, agree_fp8 = difference(forced_logits(fp8, tokens), reference)
    assert error_bf16 < error_fp8 < 0.15 and agree_fp8 >= 0.8 and agree_bf16 > agree_fp8
    ours = greedy(ReferenceEngine(fp8, max_tokens=512))
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) - len(p)
             for p, x, y in zip(PROMPTS, tokens, ours)]
    assert min(first) >= 3, first


def test_the_passes_keep_an_fp8_cache_exact(folder):
    """float32 activations: the kernel DAG's rounding points are the declared graph's, so the two agree to the bit."""
    model = load_model(folder, kv_cache_dtype="fp8")
    declared = greedy(ReferenceEngine(model, max_tokens=512), steps=8)
    lowered = greedy(ReferenceEngine(model, max_tokens=512, graph=lower(model.spec.graph)[0]), steps=8)
    assert declared == lowered


@pytest.mark.parametrize("split_kv", [0, 16], ids=["flash_16", "split_kv_16"])
def test_triton_kernels_write_and_read_an_fp8_cache_as_the_reference_does(split_kv):
    """Whole steps (a packed prefill, a mixed step, one sequence alone) of Qwen3's generated kernels under the
    interpreter, with scales other than 1 (0.5 for keys, 0.75 for values)."""
    import test_archs_triton as archs

    dag = dag_modules()["Qwen3ForCausalLM"]
    raw = normalize_hf_config({**dag.TINY_CONFIG, **archs.SMALL, "torch_dtype": "float32"})
    lowered, _ = lower(apply_kv_cache_dtype(dag.build_graph(parse_config(dag.Config, raw, "qwen3")), "fp8"))
    rng = np.random.default_rng(3)
    weights = {name: (rng.standard_normal(t.shape) * 0.5).astype(t.dtype.np_dtype)
               for name, t in lowered.checkpoint_params().items()}
    weights |= {n: np.concatenate([weights[s] for s in d.sources]) for n, d in lowered.derivations().items()}
    weights |= {n: np.full((1,), 0.5 if n.endswith("k_scale") else 0.75, np.float32) for n in lowered.param_defaults()}
    options = PlanOptions(block_size=archs.BLOCK_SIZE, split_kv_max_batch=split_kv)
    specs = {(g.name, n.name): plan_kernel(g, n, options) for g in lowered.all_graphs() for n in g.nodes
             if n.op == KERNEL}
    model = archs.Model("Qwen3ForCausalLM", "float32", raw["vocab_size"], lowered, specs, weights)
    expected = archs.workload(model, lambda inputs, states: run_graph(lowered, inputs, weights, states))
    executor = InterpretedExecutor(lowered, specs)
    got = archs.workload(model, lambda inputs, states: executor.run(
        inputs, weights, {n: to_torch(s) for n, s in states.items()}))
    for step, ours, theirs in zip(archs.STEPS, got, expected):
        assert archs.relative_error(ours[0], theirs[0]) < 1e-5, f"{step} step logits"


@pytest.mark.parametrize("variant, step", [("flash_64", "LONG_CHUNK"), ("flash_16", "LONG_CHUNK"),
                                           ("split_kv_16", "SHORT_CHUNK"), ("split_kv_prefetch_16", "SHORT_CHUNK")])
def test_every_attention_variant_reads_an_fp8_cache_into_bf16_queries(variant, step):
    """bf16 queries take e4m3's bits moved into bf16 (scaled by 2^-120, undone in the scales), normals and
    subnormals alike; the products and sums are the bf16 cache's, so the bound is bf16's probabilities'."""
    import test_attention_variants as cases

    config = qwen3.Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                          rope_theta=1e4, attention_bias=False, tie_word_embeddings=True, torch_dtype="bfloat16")
    lowered, _ = lower(apply_kv_cache_dtype(qwen3.build_graph(config), "fp8"))
    graph, node = next((g, n) for g in lowered.all_graphs() for n in g.nodes
                       if n.op == KERNEL and n.attrs["kind"] == "paged_attention")
    spec = plan_kernel(graph, node, PlanOptions(block_size=cases.BLOCK_SIZE))
    (inner,) = node.attrs["nodes"]
    query_lens, context_lens = getattr(cases, step)
    values = cases.step_inputs(np.random.default_rng(7), 8, 2, 16, query_lens, context_lens)
    values["q"] = values["q"].astype(ml_dtypes.bfloat16)
    for cache in ("k", "v"):  # magnitudes from e4m3's subnormals (below 2^-6) to hundreds
        spread = np.exp2(np.random.default_rng(8).uniform(-9, 8, values[cache].shape)).astype(np.float32)
        values[cache] = (np.sign(values[cache]) * spread / 16).astype(ml_dtypes.float8_e4m3fn)
    values |= {"k_scale": np.array([0.5], np.float32), "v_scale": np.array([0.75], np.float32)}
    sizes = {"tokens": sum(query_lens), "batch": 3, "num_blocks": 16, "block_size": cases.BLOCK_SIZE,
             "max_blocks": 5, **launch_sizes(values["q_lens"])}
    (picked,) = [v for v in spec.variants if v.name == variant]
    chosen = dataclasses.replace(spec, variants=[dataclasses.replace(picked, max_rows=None, min_sizes={})])
    env = {n: to_torch(a) for n, a in zip(inner.inputs, values.values())}
    got = to_numpy(launch_kernel(chosen, node, env, sizes)[inner.outputs[0]]).astype(np.float32)
    expected = get_op("paged_attention").reference(*values.values(), **inner.attrs)
    scale = np.abs(expected).max()
    assert np.abs(got.reshape(expected.shape) - expected).max() < 2 ** -7 * scale


def with_kv_scales(folder, out, scales: dict[str, float], scheme: dict | None = None):
    """A copy of the FP8_DYNAMIC checkpoint with a calibrated KV cache: its kv_cache_scheme and a scalar k_scale /
    v_scale for every layer, as llm-compressor writes them."""
    out.mkdir()
    for file in folder.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = scheme or {
        "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    for layer in range(LAYERS):
        for name, value in scales.items():
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def prefill(model) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    engine = ReferenceEngine(model, max_tokens=256)
    seqs = [Sequence(i, list(p)) for i, p in enumerate(PROMPTS)]
    return engine.step([Chunk(s, len(s.token_ids)) for s in seqs], all_logits=True), engine.states


def test_a_checkpoints_kv_scales_are_read_and_applied(checkpoint_factory, tmp_path):
    """A power-of-two key scale moves no rounding of e4m3's normal numbers: the cache holds those keys times 4
    exactly (the subnormals below 2^-6 gain precision, which moves the logits a little). A value scale of 0.3 stores
    v / 0.3, which reads back as v to e4m3's precision."""
    base = checkpoint_factory("kv_fp8_channel", {"num_hidden_layers": LAYERS}, quantization="fp8-channel")
    unit_logits, unit = prefill(load_model(base, kv_cache_dtype="fp8"))
    keys = load_model(with_kv_scales(base, tmp_path / "keys", {"k_scale": 0.25, "v_scale": 1.0}), kv_cache_dtype="fp8")
    logits, states = prefill(keys)
    for layer in range(LAYERS):
        plain = unit[f"kv.{layer}.k"].astype(np.float32)
        normal = np.abs(plain) > 2.0 ** -6  # rounded from a normal number
        assert normal.sum() > 1000 and np.array_equal(states[f"kv.{layer}.k"].astype(np.float32)[normal],
                                                      4 * plain[normal])
    assert 0 < np.abs(logits - unit_logits).max() / np.abs(unit_logits).max() < 1e-3
    values = load_model(with_kv_scales(base, tmp_path / "values", {"k_scale": 1.0, "v_scale": 0.3}),
                        kv_cache_dtype="fp8")
    assert values.weights["model.layers.1.self_attn.v_scale"].tolist() == [np.float32(0.3)]
    stored = prefill(values)[1]["kv.0.v"].astype(np.float32) * np.float32(0.3)  # layer 0's: the same v as unit's
    plain = unit["kv.0.v"].astype(np.float32)
    assert not np.array_equal(stored, plain) and np.abs(stored - plain).max() <= np.abs(plain).max() / 8


def test_bad_kv_cache_input_is_one_line(checkpoint_factory, folder, tmp_path):
    base = checkpoint_factory("kv_fp8_channel", {"num_hidden_layers": LAYERS}, quantization="fp8-channel")
    negative = with_kv_scales(base, tmp_path / "negative", {"k_scale": -1.0, "v_scale": 1.0})
    with pytest.raises(CheckpointError, match="tensor 'model.layers.0.self_attn.k_scale' is -1.0, expected a "
                                              "positive finite KV-cache scale"):
        load_model(negative, kv_cache_dtype="fp8")
    per_head = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    with pytest.raises(ConfigError, match="kv_cache_scheme.strategy 'channel' is not implemented"):
        load_model(with_kv_scales(base, tmp_path / "channel", {"k_scale": 1.0}, per_head))
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp16: expected one of auto, fp8"):
        load_model(folder, kv_cache_dtype="fp16")
    run = subprocess.run([sys.executable, "-m", "pegainfer.cli", "compile", str(folder), "--sm", "80",
                          "--kv-cache-dtype", "fp8", "--cache-dir", str(tmp_path / "cache")], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == (
        "pegainfer: error: --kv-cache-dtype fp8 needs sm_89 or newer (FP8 conversions); found sm_80: use "
        "--kv-cache-dtype auto there")


def test_an_fp8_cache_halves_a_tokens_bytes_and_has_its_own_manifest(folder):
    from pegainfer.backends.cache import model_id
    from pegainfer.runtime.bench import kv_bytes_per_token

    auto, fp8 = (load_spec(folder / "config.json", device="cuda", kv_cache_dtype=kv) for kv in ("auto", "fp8"))
    assert kv_bytes_per_token(fp8) * 2 == kv_bytes_per_token(auto)  # bf16 on cuda
    assert model_id(auto) != model_id(fp8)


def test_generate_takes_the_flag(folder):
    run = subprocess.run([sys.executable, "-m", "pegainfer.cli", "generate", "--model-path", str(folder),
                          "--kv-cache-dtype", "fp8", "--device", "cpu", "--prompt-ids", "5,9,200", "--max-tokens",
                          "4", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["token_ids"]) == 4
