"""The pass pipeline: every pass keeps the logits (a property over random configurations), Qwen3 lowers to at
most 7 kernels per decoder layer, kernels are named by what they compute, passes say what they could not do,
malformed graphs are refused, the generic fusion rule groups chains by itself, and memory planning does not grow
with depth."""

import dataclasses
import json

import numpy as np
import pytest

from pegainfer.errors import GraphError
from pegainfer.frontends.load import embedded_configs, load_spec
from pegainfer.ir import FP32, GraphBuilder
from pegainfer.ir.graph import KERNEL
from pegainfer.models import qwen3
from pegainfer.passes.kernels import kernels_per_layer, list_kernels
from pegainfer.passes.manager import write_dumps
from pegainfer.passes.memory import activation_bytes, check_buffers
from pegainfer.passes.pipeline import DEFAULT_PASSES, lower
from pegainfer.passes.rewrite import gemm_name
from random_models import random_qwen3_config, random_weights, run_workload, with_layers

MAX_KERNELS_PER_LAYER = 7
TOLERANCE = 1e-5


def embedded_of(architecture: str, quantized: bool = False) -> list[str]:
    """The embedded configs of `architecture`: the float ones, or the FP8 ones (those with a quantization_config)."""
    configs = {name: json.loads(path.read_text()) for name, path in embedded_configs().items()}
    return sorted(name for name, c in configs.items()
                  if c["architectures"] == [architecture] and ("quantization_config" in c) == quantized)


# Each architecture's decoder layer after the passes, kernel by kernel.
DENSE_LAYER = ["add_rms_norm_linear", "qk_rope_kv_write", "paged_attention", "linear", "add_rms_norm_linear_silu_mul",
               "linear"]
LAYER_KERNELS = {
    "LlamaForCausalLM": DENSE_LAYER,
    "Qwen2ForCausalLM": DENSE_LAYER,
    "MistralForCausalLM": DENSE_LAYER,
    # norms after attention and after the MLP: a row kernel each, the next add fused into the next GEMM's prologue
    "Gemma3ForCausalLM": ["add_rms_norm_linear", "qk_norm_rope_kv_write", "paged_attention", "linear", "rms_norm",
                          "add_rms_norm_linear_gelu_tanh_mul", "linear", "rms_norm"],
    # the normed rows feed both the router and the experts, so the norm is a row kernel of its own
    "Qwen3MoeForCausalLM": ["add_rms_norm_linear", "qk_norm_rope_kv_write", "paged_attention", "linear",
                            "add_rms_norm", "linear", "moe_route", "moe_experts"],
}


# The same layers' kernels by name: named after their GEMM (passes/rewrite.py: kernel_name), or what they compute.
DENSE_NAMES = ["qkv", "qk_rope", "attention", "o_proj", "gate_up", "down"]
LAYER_NAMES = {
    "Qwen3ForCausalLM": ["qkv", "qk_norm_rope", "attention", "o_proj", "gate_up", "down"],
    "LlamaForCausalLM": DENSE_NAMES,
    "Qwen2ForCausalLM": DENSE_NAMES,
    "MistralForCausalLM": DENSE_NAMES,
    "Gemma3ForCausalLM": ["qkv", "qk_norm_rope", "attention", "o_proj", "post_attention_layernorm", "gate_up", "down",
                          "post_feedforward_layernorm"],
    "Qwen3MoeForCausalLM": ["qkv", "qk_norm_rope", "attention", "o_proj", "mlp_norm", "router", "route", "experts"],
}


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30))


@pytest.mark.parametrize("seed", range(8))
def test_every_pass_keeps_the_logits_on_random_configs(seed):
    rng = np.random.default_rng(seed)
    config = random_qwen3_config(rng)
    graph = qwen3.build_graph(config)
    weights = random_weights(graph, rng)
    expected = run_workload(graph, weights, config.vocab_size)
    _, records = lower(graph)
    for record in records:
        derived = {name: np.concatenate([weights[s] for s in d.sources], axis=d.axis)
                   for name, d in record.graph.derivations().items()}
        got = run_workload(record.graph, {**weights, **derived}, config.vocab_size)
        for step in (0, 1):  # the first output of each step is the logits
            ours, theirs = got[step * len(got) // 2], expected[step * len(expected) // 2]
            assert relative_error(ours, theirs) < TOLERANCE, f"{config} after {record.name}, step {step}"


def test_sampler_tail_outputs_agree_with_the_logits():
    rng = np.random.default_rng(3)
    config = random_qwen3_config(rng)
    lowered, _ = lower(qwen3.build_graph(config))
    weights = random_weights(lowered, rng)
    derived = {n: np.concatenate([weights[s] for s in d.sources]) for n, d in lowered.derivations().items()}
    logits, top_values, top_ids, logsumexp = run_workload(lowered, {**weights, **derived}, config.vocab_size)[:4]
    # the workload's rows are greedy and ask no top logprobs: each gets its largest alone, nothing ranked
    np.testing.assert_array_equal(top_ids[:, 0], np.argmax(logits, axis=1))
    np.testing.assert_allclose(top_values[:, 0], logits.max(axis=1))
    assert (top_ids[:, 1:] == -1).all() and (top_values[:, 1:] == -np.inf).all()
    np.testing.assert_allclose(logsumexp, np.log(np.exp(logits.astype(np.float64)).sum(axis=1)), rtol=1e-5)


@pytest.mark.parametrize("name", embedded_of("Qwen3ForCausalLM"))
def test_qwen3_decoder_layer_is_at_most_seven_kernels(name):
    lowered, _ = lower(load_spec(embedded_configs()[name]).graph)
    (count,) = kernels_per_layer(lowered).values()
    print(f"{name}: {count} kernels per decoder layer, "
          f"{sum(k.launches for k in list_kernels(lowered))} launches per step")
    assert count <= MAX_KERNELS_PER_LAYER
    kinds = [k.kind for k in list_kernels(lowered) if k.graph == "qwen3_layer"]
    assert kinds == ["add_rms_norm_linear", "qk_norm_rope_kv_write", "paged_attention", "linear",
                     "add_rms_norm_linear_silu_mul", "linear"]


@pytest.mark.parametrize("name", embedded_of("Qwen3ForCausalLM", quantized=True))
def test_qwen3_fp8_configs_lower_to_the_float_layer_with_fp8_weights(name):
    """Qwen's own Qwen3-*-FP8 (quant_method fp8, 128 x 128 blocks): the float sibling's six kernels a layer, each
    GEMM reading its weight as FP8 (the dequantize in its prologue), QKV and gate/up merged with their scales."""
    lowered, _ = lower(load_spec(embedded_configs()[name]).graph)
    float_graph = lower(load_spec(embedded_configs()[name.removesuffix("-fp8")]).graph)[0]
    float_kinds = [k.kind for k in list_kernels(float_graph) if k.graph == "qwen3_layer"]
    kinds = [k.kind for k in list_kernels(lowered) if k.graph == "qwen3_layer"]
    assert kinds == [f"dequantize_{k}" if "linear" in k else k for k in float_kinds]
    body = lowered.subgraphs["qwen3_layer"]
    assert body.params["model.layers.{layer}.self_attn.q_proj+k_proj+v_proj.weight"].dtype.name == "f8e4m3"


@pytest.mark.parametrize("architecture", sorted(LAYER_KERNELS))
def test_every_embedded_config_of_the_other_architectures_lowers_to_its_layer_kernels(architecture):
    names = embedded_of(architecture)
    assert names, f"no embedded config of {architecture}"
    for name in names:
        spec = load_spec(embedded_configs()[name])
        lowered, _ = lower(spec.graph)
        layers = [n for n in lowered.nodes if n.op == "repeat"]
        assert sum(n.attrs["count"] * n.attrs.get("layers", 1) for n in layers) == spec.config.num_hidden_layers
        for repeat in layers:
            body = lowered.subgraphs[repeat.attrs["body"]]
            kinds = [k.kind for k in list_kernels(lowered) if k.graph == body.name]
            assert kinds == LAYER_KERNELS[architecture] * repeat.attrs.get("layers", 1), f"{name}: {body.name}"
        print(f"{name}: {kernels_per_layer(lowered)} kernels per decoder layer, "
              f"{sum(k.launches for k in list_kernels(lowered))} launches per step")


@pytest.mark.parametrize("architecture", sorted(LAYER_NAMES))
def test_kernels_are_named_by_what_they_compute_in_every_architecture(architecture):
    """Each layer's kernels by name, the j-th layer of a body with `.j`; the step ends in `lm_head`. A kernel's
    name is unique in its graph and never another node's value (the manifest and the executor key on it)."""
    lowered, _ = lower(load_spec(embedded_configs()[embedded_of(architecture)[0]]).graph)
    for repeat in [n for n in lowered.nodes if n.op == "repeat"]:
        body = lowered.subgraphs[repeat.attrs["body"]]
        expected = [name + (f".{j}" if j else "") for j in range(repeat.attrs.get("layers", 1))
                    for name in LAYER_NAMES[architecture]]
        assert [k.name for k in list_kernels(lowered) if k.graph == body.name] == expected
    assert [k.name for k in list_kernels(lowered) if k.graph == lowered.name][-1] == "lm_head"
    for g in lowered.all_graphs():
        kernels = [n for n in g.nodes if n.op == KERNEL]
        assert len({n.name for n in g.nodes}) == len(g.nodes), g.name
        values = {out: n for n in g.nodes for out in n.outputs}
        assert all(values.get(k.name, k) is k for k in kernels), g.name


@pytest.mark.parametrize("value,name", [("q_proj+k_proj+v_proj", "qkv"), ("gate.3+up.3", "gate_up.3"),
                                        ("o_proj", "o_proj"), ("q_proj.1+k_proj", "q_proj.1+k_proj")])
def test_a_merged_gemm_is_named_by_the_stems_of_its_parts(value, name):
    assert gemm_name(value) == name


def test_a_body_of_alternating_layers_names_each_layer_by_its_index():
    """Gemma 3 1B: five local layers and a global one, 26 layers: a body of 6 run 4 times and one of 1 run twice."""
    spec = load_spec(embedded_configs()["gemma-3-1b"])
    repeats = [(n.attrs["body"], n.attrs["count"], n.attrs.get("layers", 1)) for n in spec.graph.nodes
               if n.op == "repeat"]
    assert repeats == [("gemma3_layers0", 4, 6), ("gemma3_layers24", 2, 1)]
    params = spec.graph.checkpoint_params()
    assert {f"model.layers.{i}.self_attn.q_norm.weight" for i in range(26)} <= set(params)
    assert len([p for p in params if p.endswith("q_norm.weight")]) == 26
    attention = {n.inputs[1]: n.attrs.get("window", 0) for g in spec.graph.subgraphs.values() for n in g.nodes
                 if n.op == "paged_attention"}
    assert attention["kv_write.5#0"] == 0 and attention["kv_write#0"] == 512  # layer 5 is global, layer 0 local
    states = spec.graph.expanded_states()
    assert len(states) == 52 and "kv.25.k" in states


def test_weight_merges_are_recorded_as_derived_params():
    lowered, _ = lower(load_spec(embedded_configs()["qwen3-4b"]).graph)
    body = lowered.subgraphs["qwen3_layer"]
    qkv = body.derived["model.layers.{layer}.self_attn.q_proj+k_proj+v_proj.weight"]
    assert qkv.sources == tuple(f"model.layers.{{layer}}.self_attn.{p}_proj.weight" for p in "qkv")
    assert body.params["model.layers.{layer}.self_attn.q_proj+k_proj+v_proj.weight"].shape == (6144, 2560)
    assert "model.layers.{layer}.mlp.gate_proj+up_proj.weight" in body.derived
    checkpoint = lowered.checkpoint_params()
    assert "model.layers.35.self_attn.k_proj.weight" in checkpoint
    assert not any("+" in name for name in checkpoint), "the loader reads Hugging Face names only"


def test_a_pass_that_cannot_rewrite_says_so_and_keeps_the_graph():
    b = GraphBuilder("norm_read_twice")
    x = b.input("x", FP32, ("tokens", 8))
    normed = b.rms_norm(x, b.param("norm.w", FP32, (8,)), eps=1e-6, name="normed")
    projected = b.linear(normed, b.param("proj.w", FP32, (8, 8)), name="proj")
    graph = b.finish(b.add(normed, projected, name="out"))
    lowered, records = lower(graph)
    notes = {r.name: r.notes for r in records}
    assert any("%normed not fused into %proj: its output is read elsewhere too" in n
               for n in notes["fuse_norm_prologue"])
    assert "# note: norm_read_twice: %normed not fused" in next(r.dump() for r in records
                                                                if r.name == "fuse_norm_prologue")
    rng = np.random.default_rng(0)
    inputs, weights = {"x": rng.standard_normal((3, 8)).astype(np.float32)}, \
        {"norm.w": rng.standard_normal(8).astype(np.float32), "proj.w": rng.standard_normal((8, 8)).astype(np.float32)}
    from pegainfer.ir.interpreter import run_graph
    np.testing.assert_allclose(run_graph(lowered, inputs, weights, {})[0], run_graph(graph, inputs, weights, {})[0],
                               rtol=1e-6)


def test_a_malformed_graph_fails_verification_naming_the_node():
    graph = qwen3.build_graph(random_qwen3_config(np.random.default_rng(0)))
    body = graph.subgraphs["qwen3_layer"]
    index = next(i for i, n in enumerate(body.nodes) if n.name == "o_proj")
    body.nodes[index] = dataclasses.replace(body.nodes[index], inputs=("missing_value", *body.nodes[index].inputs[1:]))
    with pytest.raises(GraphError, match=r"node %o_proj \(linear\): input 'missing_value' is not defined"):
        lower(graph)


def test_generic_rule_fuses_a_chain_with_one_reduction():
    b = GraphBuilder("chain")
    x, y = b.input("x", FP32, ("tokens", 6)), b.input("y", FP32, ("tokens", 6))
    w = b.param("w", FP32, (6,))
    h = b.mul(b.silu(x, name="act"), y, name="gated")
    h = b.rms_norm(b.mul(h, x, name="product"), w, eps=1e-5, name="norm1")
    h = b.mul(h, y, name="scaled")
    out = b.rms_norm(h, w, eps=1e-5, name="norm2")  # a second reduction starts a second kernel
    graph = b.finish(out)
    lowered, _ = lower(graph)
    kernels = [(n.attrs["kind"], [i.op for i in n.attrs["nodes"]]) for n in lowered.nodes if n.op == KERNEL]
    assert kernels[0] == ("elementwise_reduce", ["silu", "mul", "mul", "rms_norm", "mul"])
    assert kernels[1] == ("rms_norm", ["rms_norm"])
    from pegainfer.ir.interpreter import run_graph
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((4, 6)).astype(np.float32), "y": rng.standard_normal((4, 6)).astype(np.float32)}
    weights = {"w": rng.standard_normal(6).astype(np.float32)}
    np.testing.assert_allclose(run_graph(lowered, inputs, weights, {})[0], run_graph(graph, inputs, weights, {})[0],
                               rtol=1e-5, atol=1e-6)


def test_activation_memory_does_not_grow_with_depth():
    config = random_qwen3_config(np.random.default_rng(5))
    sizes = {"tokens": 100, "batch": 4, "samples": 4, "max_blocks": 8}
    totals = []
    for layers in (1, 4, 12):
        lowered, _ = lower(qwen3.build_graph(with_layers(config, layers)))
        for g in lowered.all_graphs():
            check_buffers(g)
        totals.append(sum(activation_bytes(g, sizes) for g in lowered.all_graphs()))
    assert totals[0] == totals[1] == totals[2]
    body = lowered.subgraphs["qwen3_layer"]
    assert len(set(body.buffers.values())) < len({v for v in body.buffers}), "buffers must be reused"


def test_dumps_are_written_after_each_pass(tmp_path):
    _, records = lower(load_spec(embedded_configs()["qwen3-0.6b"]).graph)
    written = write_dumps(records, tmp_path)
    assert [p.name for p in written] == [f"{i:02d}-{p.name}.txt" for i, p in enumerate(DEFAULT_PASSES, start=1)]
    assert written[2].read_text().startswith("# after pass 3: merge_sibling_linears (weight_transforms): Merges")
    assert [p.name for p in write_dumps(records, tmp_path / "one", "form_kernels")] == ["14-form_kernels.txt"]
    with pytest.raises(GraphError, match="--dump-after nope: no such pass"):
        write_dumps(records, tmp_path, "nope")
