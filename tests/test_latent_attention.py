"""Multi-head latent attention and DeepSeek-style routing: the ops against transformers' own functions (YaRN's
frequencies, interleaved RoPE, the V2 and V3 routers), the absorbed form equal to the declared one, config errors,
the embedded configs and the latent cache's size."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import normalize_hf_config, parse_config
from pegainfer.frontends.kv_cache import apply_kv_cache_dtype
from pegainfer.ir.ops.attention import _rope, rope_cos_sin, rope_inv_freq
from pegainfer.ir.ops.latent_attention import _head_linear, _latent_attention, _latent_write, _mla
from pegainfer.ir.ops.moe import _route
from pegainfer.models import deepseek_v2, deepseek_v3
from pegainfer.models.latent_attention import latent_rope, softmax_scale

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}


def test_yarn_frequencies_and_attention_factor_match_transformers():
    config = transformers.DeepseekV3Config(qk_rope_head_dim=64, rope_scaling=dict(YARN, rope_theta=10000.0),
                                           max_position_embeddings=163840)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = latent_rope(YARN, 64, 10000.0)
    positions = np.array([0, 1, 17, 300, 1000])
    cos, sin = rope_cos_sin(positions, 64, 10000.0, scaling)
    angles = positions[:, None].astype(np.float32) * inv_freq.numpy()[None, :]
    np.testing.assert_allclose(cos[:, :32], np.cos(angles) * factor, atol=1e-4)
    np.testing.assert_allclose(sin[:, 32:], np.sin(angles) * factor, atol=1e-4)
    assert factor != 1.0 and scaling[2] < scaling[3], "the case must exercise the ramp and the attention factor"
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert softmax_scale(YARN, 192) == pytest.approx(192 ** -0.5 * mscale ** 2)


def test_interleaved_rope_matches_transformers_complex_form():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)
    positions = np.array([0, 3, 9, 10, 200])
    scaling = latent_rope(dict(YARN, original_max_position_embeddings=64), 8, 10000.0)
    angles = positions[:, None].astype(np.float32) * rope_inv_freq(8, 10000.0, scaling)[None, :]
    freqs = torch.polar(torch.ones(5, 4), torch.from_numpy(angles)) * scaling[4]
    heads_first = torch.from_numpy(x).transpose(0, 1)[None]  # transformers' [batch, heads, tokens, dims]
    theirs, _ = hf_v2.apply_rotary_emb(heads_first, heads_first, freqs[None])
    ours = _rope(x, positions, theta=10000.0, scaling=scaling, interleaved=True)
    np.testing.assert_allclose(ours, theirs[0].transpose(0, 1).numpy(), rtol=1e-5, atol=1e-5)


def _hf_router(module, config, logits: np.ndarray, bias: np.ndarray | None = None):
    router = module(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(config.hidden_size)[: router.weight.shape[0]])
        if bias is not None:
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, weights, ids = router(torch.from_numpy(logits))
    return weights.numpy(), ids.numpy()


@pytest.mark.parametrize("groups", [None, (4, 2)], ids=["greedy", "group_limited"])
def test_softmax_routing_matches_the_v2_router(groups):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((40, 16)).astype(np.float32) * 2
    config = transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3,
                                           routed_scaling_factor=16.0,
                                           topk_method="group_limited_greedy" if groups else "greedy",
                                           n_group=groups and groups[0], topk_group=groups and groups[1])
    weights, ids = _hf_router(hf_v2.DeepseekV2TopkRouter, config, logits)
    attrs = dict(groups=groups[0], topk_group=groups[1]) if groups else {}
    ours_w, ours_ids = _route(logits, k=3, normalize=False, scale=16.0, **attrs)
    _assert_same_choice(ours_w, ours_ids, weights, ids)


@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid_routing_with_bias_and_groups_matches_the_v3_router(normalize):
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((40, 32)).astype(np.float32)
    bias = (rng.standard_normal(32) * 0.3).astype(np.float32)
    config = transformers.DeepseekV3Config(hidden_size=32, num_attention_heads=4, n_routed_experts=32, num_experts_per_tok=4, n_group=8,
                                           topk_group=3, norm_topk_prob=normalize, routed_scaling_factor=2.5)
    weights, ids = _hf_router(hf_v3.DeepseekV3TopkRouter, config, logits, bias)
    ours_w, ours_ids = _route(logits, bias, k=4, normalize=normalize, scoring="sigmoid", groups=8, topk_group=3,
                              group_score="top2", scale=2.5)
    _assert_same_choice(ours_w, ours_ids, weights, ids)
    unbiased_ids = _route(logits, k=4, normalize=normalize, scoring="sigmoid", groups=8, topk_group=3,
                          group_score="top2", scale=2.5)[1]
    assert (np.sort(unbiased_ids) != np.sort(ours_ids)).any(), "the bias must change some choice"


def _assert_same_choice(ours_w, ours_ids, weights, ids) -> None:
    """The same experts with the same weights per token (top-k's order is not part of the result)."""
    for row in range(len(ids)):
        theirs = dict(zip(ids[row].tolist(), weights[row].tolist()))
        mine = dict(zip(ours_ids[row].tolist(), ours_w[row].tolist()))
        assert mine.keys() == theirs.keys(), f"row {row}"
        assert np.allclose([mine[e] for e in theirs], list(theirs.values()), rtol=1e-5)


def _packed_step(rng):
    """A latent cache of blocks of 4 holding three sequences: a fresh prompt of 5, a chunk of 3 after 6 cached
    tokens, a decode token after 10."""
    latent_dim, rope_dim, heads = 24, 8, 3
    cache = np.zeros((16, 4, 1, latent_dim + rope_dim), np.float32)
    contexts, queries = [5, 9, 11], [5, 3, 1]
    tables = np.array([[0, 1, 2, -1], [3, 4, 5, -1], [6, 7, 8, -1]], np.int32)
    slots = np.concatenate([[tables[b, p // 4] * 4 + p % 4 for p in range(c)] for b, c in enumerate(contexts)])
    _latent_write(cache, rng.standard_normal((len(slots), latent_dim)), rng.standard_normal((len(slots), rope_dim)),
                  slots.astype(np.int32))
    tokens = sum(queries)
    step = (tables, np.array([0, 5, 8], np.int32), np.array(queries, np.int32), np.array(contexts, np.int32))
    q_rope = rng.standard_normal((tokens, heads, rope_dim)).astype(np.float32)
    return cache, step, q_rope, latent_dim, heads


def test_absorbed_attention_equals_the_declared_form():
    rng = np.random.default_rng(3)
    cache, step, q_rope, latent_dim, heads = _packed_step(rng)
    nope, value_dim = 16, 12
    kv_b = rng.standard_normal((heads * (nope + value_dim), latent_dim)).astype(np.float32) * 0.3
    q_nope = rng.standard_normal((q_rope.shape[0], heads, nope)).astype(np.float32)
    declared = _mla(q_nope, q_rope, cache, kv_b, *step, scale=0.2)
    per_head = kv_b.reshape(heads, nope + value_dim, latent_dim)
    keys, values = per_head[:, :nope].reshape(-1, latent_dim), per_head[:, nope:].reshape(-1, latent_dim)
    q_latent = _head_linear(q_nope, keys, transposed=True)
    absorbed = _head_linear(_latent_attention(q_latent, q_rope, cache, *step, scale=0.2), values)
    np.testing.assert_allclose(absorbed, declared, rtol=1e-4, atol=1e-5)
    assert np.abs(declared).max() > 0.1


def test_latent_write_skips_padding_and_stores_latent_then_rope_key():
    cache = np.zeros((2, 4, 1, 5), np.float32)
    _latent_write(cache, np.ones((3, 3)), np.full((3, 2), 2.0), np.array([5, -1, 0], np.int32))
    flat = cache.reshape(-1, 5)
    assert flat[5].tolist() == [1, 1, 1, 2, 2] and flat[0].tolist() == [1, 1, 1, 2, 2]
    assert np.count_nonzero(flat) == 10


@pytest.mark.parametrize("module, overrides, message", [
    (deepseek_v2, {"norm_topk_prob": True}, "norm_topk_prob true is not implemented"),
    (deepseek_v2, {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not implemented"),
    (deepseek_v2, {"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1}, "n_group 3 must divide"),
    (deepseek_v3, {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "exceeds the 1 groups' 2 experts"),
    (deepseek_v3, {"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    (deepseek_v3, {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "needs numbers factor and original"),
])
def test_unsupported_settings_fail_in_one_line(module, overrides, message):
    config = parse_config(module.Config, normalize_hf_config({**module.TINY_CONFIG, **overrides}), "x")
    with pytest.raises(ConfigError, match=message):
        module.check_config(config)


def test_fp8_latent_cache_is_refused():
    config = parse_config(deepseek_v2.Config, normalize_hf_config(deepseek_v2.TINY_CONFIG), "x")
    with pytest.raises(ConfigError, match="FP8 latent attention cache is not implemented"):
        apply_kv_cache_dtype(deepseek_v2.build_graph(config), "fp8")


def test_inspect_prints_the_latent_cache_against_per_head_keys():
    out = subprocess.run([sys.executable, "-m", "pegainfer.cli", "inspect", "deepseek-v3"], capture_output=True,
                         text=True, check=True).stdout
    # 61 layers of 576 bf16 values; 128 heads x (192 key + 128 value dims) per layer without the latent
    assert "KV cache: 70272 bytes a token over 61 cache tensors" in out
    assert "latent attention: 576 values a token a layer, where per-head keys and values would be 40960" in out


@pytest.mark.parametrize("name, experts, layers", [("deepseek-v2-lite", 64, 27), ("deepseek-v3", 256, 61),
                                                    ("kimi-k2", 384, 61)])
def test_embedded_configs_build(name, experts, layers):
    from pegainfer.frontends.load import load_spec, resolve_config_path
    spec = load_spec(resolve_config_path(name), device="cpu")
    assert spec.config.n_routed_experts == experts and spec.config.num_hidden_layers == layers
    assert sum(1 for n in spec.graph.expanded_states() if n.startswith("kv.")) == layers


def test_the_router_keeps_float32_logits_in_its_own_gemm():
    """transformers scores experts from float32 logits; a bf16 router's rounding would flip near ties. The router
    GEMM therefore stays apart from the shared experts' gate/up merge, whose output is bf16."""
    from pegainfer.passes.pipeline import lower
    raw = normalize_hf_config({**deepseek_v3.TINY_CONFIG, "torch_dtype": "bfloat16"})
    lowered, _ = lower(deepseek_v3.build_graph(parse_config(deepseek_v3.Config, raw, "x")))
    body = next(g for g in lowered.all_graphs() if any(n.name == "router" for n in g.nodes))
    (router,) = [n for n in body.nodes if n.name == "router"]
    assert router.output_types[0].dtype.name == "f32"
    assert [n.op for n in router.attrs["nodes"]] == ["linear"]
    route = next(n for n in body.nodes if n.name == "route")
    assert route.inputs[0] == router.outputs[0]
