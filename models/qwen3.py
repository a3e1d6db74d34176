"""Qwen3 (dense): the architecture as a DAG of IR ops over Hugging Face weight names. No kernels, no scheduling."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, Value, dtype_from_name
from pegainfer.ir.step import AttentionInputs, declare_attention_inputs, declare_step_inputs, kv_cache_shape
from pegainfer.models.blocks import HeadShape

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPE = "qwen3"


@dataclass(frozen=True)
class Config(HeadShape):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    use_sliding_window: bool = False
    torch_dtype: str = "bfloat16"


def check_config(config: Config) -> None:
    require_positive(config, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim")
    require_float_dtype(config.torch_dtype)
    if config.hidden_act != "silu":
        raise ConfigError(f"hidden_act {config.hidden_act!r} is not implemented for Qwen3 (expected 'silu')")
    if config.rope_scaling is not None:
        raise ConfigError(f"rope_scaling {config.rope_scaling!r} is not implemented for Qwen3 (expected null)")
    if config.use_sliding_window:
        raise ConfigError("use_sliding_window true is not implemented for Qwen3 (expected false)")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConfigError(f"num_attention_heads {config.num_attention_heads} must be a multiple of "
                          f"num_key_value_heads {config.num_key_value_heads}")


def build_graph(config: Config) -> Graph:
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder("qwen3")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    embed = b.param("model.embed_tokens.weight", dtype, (config.vocab_size, config.hidden_size))
    hidden = b.embedding(input_ids, embed, name="embed")
    (hidden,) = b.repeat(build_layer(config), config.num_hidden_layers, carried=[hidden],
                         invariant=attention.as_list())
    hidden = b.gather_rows(hidden, logits_indices, name="sampled_rows")
    hidden = b.rms_norm(hidden, b.param("model.norm.weight", dtype, (config.hidden_size,)),
                        eps=config.rms_norm_eps, name="final_norm")
    lm_head = embed if config.tie_word_embeddings else \
        b.param("lm_head.weight", dtype, (config.vocab_size, config.hidden_size))
    return b.finish(b.linear(hidden, lm_head, name="logits"))


def build_layer(config: Config) -> Graph:
    """One decoder layer; `{layer}` in weight names is the layer index."""
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder("qwen3_layer", body=True)
    residual = b.input("hidden", dtype, ("tokens", config.hidden_size))
    attention = declare_attention_inputs(b)

    def weight(name: str, *shape: int) -> Value:
        return b.param(f"model.layers.{{layer}}.{name}", dtype, shape)

    normed = b.rms_norm(residual, weight("input_layernorm.weight", config.hidden_size), eps=config.rms_norm_eps,
                        name="attn_norm")
    attn = _self_attention(b, config, normed, attention, weight)
    residual = b.add(residual, attn, name="attn_residual")
    normed = b.rms_norm(residual, weight("post_attention_layernorm.weight", config.hidden_size),
                        eps=config.rms_norm_eps, name="mlp_norm")
    gate = b.linear(normed, weight("mlp.gate_proj.weight", config.intermediate_size, config.hidden_size), name="gate")
    up = b.linear(normed, weight("mlp.up_proj.weight", config.intermediate_size, config.hidden_size), name="up")
    act = b.mul(b.silu(gate, name="gate_act"), up, name="gated")
    down = b.linear(act, weight("mlp.down_proj.weight", config.hidden_size, config.intermediate_size), name="down")
    return b.finish(b.add(residual, down, name="mlp_residual"))


def _self_attention(b: GraphBuilder, config: Config, x: Value, attention: AttentionInputs, weight) -> Value:
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.dims_per_head
    dtype = x.dtype

    def project(name: str, out_heads: int) -> Value:
        w = weight(f"self_attn.{name}.weight", out_heads * head_dim, config.hidden_size)
        bias = [weight(f"self_attn.{name}.bias", out_heads * head_dim)] if config.attention_bias else []
        flat = b.linear(x, w, *bias, name=name)
        return b.reshape(flat, shape=("tokens", out_heads, head_dim), name=f"{name}_heads")

    def norm_and_rope(value: Value, norm: str) -> Value:
        normed = b.rms_norm(value, weight(f"self_attn.{norm}.weight", head_dim), eps=config.rms_norm_eps, name=norm)
        return b.rope(normed, attention.positions, theta=config.rope_theta, name=f"{norm[0]}_rope")

    q = norm_and_rope(project("q_proj", heads), "q_norm")
    k = norm_and_rope(project("k_proj", kv_heads), "k_norm")
    v = project("v_proj", kv_heads)
    k_cache = b.state("kv.{layer}.k", dtype, kv_cache_shape(kv_heads, head_dim))
    v_cache = b.state("kv.{layer}.v", dtype, kv_cache_shape(kv_heads, head_dim))
    k_cache, v_cache = b.kv_write(k_cache, v_cache, k, v, attention.slot_mapping, name="kv_write")
    out = b.paged_attention(q, k_cache, v_cache, attention.block_tables, attention.seq_starts, attention.query_lens,
                            attention.context_lens, scale=head_dim ** -0.5, name="attention")
    out = b.reshape(out, shape=("tokens", heads * head_dim), name="attention_flat")
    o_bias = [weight("self_attn.o_proj.bias", config.hidden_size)] if config.attention_bias else []
    return b.linear(out, weight("self_attn.o_proj.weight", config.hidden_size, heads * head_dim), *o_bias,
                    name="o_proj")


TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": MODEL_TYPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}
