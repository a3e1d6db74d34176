"""`pegainfer bench`'s floors: a decode step reads every dense weight but of each routed expert only its expected
share, and a prefill multiplies an expert's weights by its share of the tokens."""

from math import prod

import pytest

from pegainfer.frontends.load import load_spec, resolve_config_path
from pegainfer.ir.dtypes import F8E4M3
from pegainfer.runtime.bench import (TENSOR_FLOP_PER_S, fp8_gemm_flops, prefill_floor_ms, prefill_flops,
                                     routed_shares, weight_bytes)


@pytest.fixture(scope="module")
def moe_spec():
    return load_spec(resolve_config_path("deepseek-v2-lite"))


def test_a_dense_model_reads_all_its_weights_at_any_batch():
    spec = load_spec(resolve_config_path("qwen3-0.6b"))
    total = sum(prod(t.shape) * t.dtype.itemsize for t in spec.graph.checkpoint_params().values())
    assert routed_shares(spec, 1) == {}
    assert weight_bytes(spec, 1) == weight_bytes(spec, 256) == total


def test_decode_reads_each_routed_expert_by_the_chance_a_token_picks_it(moe_spec):
    config = moe_spec.config
    shares = routed_shares(moe_spec, 1)
    routed = 2 * config.n_routed_experts * 3 * (config.num_hidden_layers - config.first_k_dense_replace) // 2
    assert len(shares) == routed, "every routed expert's gate, up and down in every MoE layer"
    assert "model.layers.1.mlp.experts.63.down_proj.weight" in shares
    assert not any(".shared_experts." in name or ".layers.0." in name for name in shares)
    k_over_e = config.num_experts_per_tok / config.n_routed_experts
    assert list(shares.values()) == pytest.approx([k_over_e] * routed)
    assert list(routed_shares(moe_spec, 8).values()) == pytest.approx([1 - (1 - k_over_e) ** 8] * routed)
    full, one, many = weight_bytes(moe_spec), weight_bytes(moe_spec, 1), weight_bytes(moe_spec, 4096)
    assert one < 0.2 * full and many == pytest.approx(full, rel=1e-6)


def test_prefill_flops_count_an_expert_for_its_tokens_only(moe_spec):
    config = moe_spec.config
    shares = routed_shares(moe_spec, None)
    experts = sum(prod(t.shape) for name, t in moe_spec.graph.checkpoint_params().items() if name in shares)
    dense = sum(prod(t.shape) for name, t in moe_spec.graph.checkpoint_params().items() if name not in shares)
    k_over_e = config.num_experts_per_tok / config.n_routed_experts
    head = config.vocab_size * config.hidden_size
    gemm = 2 * (dense + experts * k_over_e - head) * 1000 + 2 * head
    assert gemm < prefill_flops(moe_spec, 1000) < gemm * 1.2  # the rest is attention


def test_an_fp8_prefill_floor_prices_its_e4m3_projections_at_twice_the_bf16_rate():
    path = resolve_config_path("qwen3-0.6b")
    plain, fp8 = load_spec(path), load_spec(path, quantization="fp8")
    config = plain.config
    layer = config.hidden_size * (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim + \
        config.num_attention_heads * config.head_dim * config.hidden_size + 3 * config.hidden_size * \
        config.intermediate_size
    assert fp8_gemm_flops(plain, 1000) == 0
    assert fp8_gemm_flops(fp8, 1000) == 2 * layer * config.num_hidden_layers * 1000  # every projection, no LM head
    assert prefill_flops(fp8, 1000) == prefill_flops(plain, 1000)
    bf16_ms = prefill_flops(plain, 1000) / TENSOR_FLOP_PER_S * 1e3
    assert prefill_floor_ms(plain, 1000) == pytest.approx(bf16_ms)
    saved = fp8_gemm_flops(fp8, 1000) / (2 * TENSOR_FLOP_PER_S) * 1e3
    assert prefill_floor_ms(fp8, 1000) == pytest.approx(bf16_ms - saved)


def test_routed_experts_in_fp8_count_at_the_bf16_rate():
    fp8 = load_spec(resolve_config_path("deepseek-v2-lite"), quantization="fp8")
    params, shares = fp8.graph.checkpoint_params(), routed_shares(fp8, None)
    e4m3 = {name for name, t in params.items() if t.dtype == F8E4M3}
    assert shares and set(shares) <= e4m3, "the routed experts are stored in e4m3"
    assert fp8_gemm_flops(fp8, 10) == sum(2 * prod(params[name].shape) * 10 for name in e4m3 - set(shares))
