"""Qwen3 (dense): Llama's pre-norm layer with an RMSNorm over each head of q and k before RoPE. A DAG of IR ops
over Hugging Face weight names, built from models/blocks.py; no kernels, no scheduling."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, Value, dtype_from_name
from pegainfer.ir.layers import LayerSlot, repeat_layers
from pegainfer.ir.step import AttentionInputs, declare_step_inputs
from pegainfer.models.blocks import (AttentionSpec, HeadShape, glu_activation, lm_head, pre_norm_layer,
                                     require_grouped_heads)

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
    require_grouped_heads(config.num_attention_heads, config.num_key_value_heads)


def build_graph(config: Config) -> Graph:
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder("qwen3")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    embed = b.param("model.embed_tokens.weight", dtype, (config.vocab_size, config.hidden_size))
    hidden = b.embedding(input_ids, embed, name="embed")
    hidden = repeat_layers(b, "qwen3", ["decoder"] * config.num_hidden_layers, _layer(config), hidden, attention)
    return b.finish(lm_head(b, hidden, logits_indices, embed, config.vocab_size, config.rms_norm_eps,
                            config.tie_word_embeddings))


def _layer(config: Config):
    """The pre-norm decoder layer, with an RMSNorm over each head of q and k before RoPE (Qwen3's addition)."""
    spec = AttentionSpec(hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.kv_heads,
                         head_dim=config.dims_per_head, theta=config.rope_theta, qkv_bias=config.attention_bias,
                         o_bias=config.attention_bias, qk_norm_eps=config.rms_norm_eps)

    def layer(b: GraphBuilder, residual: Value, attention: AttentionInputs, slot: LayerSlot) -> Value:
        return pre_norm_layer(b, residual, attention, slot.index, spec, config.intermediate_size,
                              config.rms_norm_eps, glu_activation(config.hidden_act))
    return layer


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
