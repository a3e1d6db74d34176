"""Llama (Llama 2 and 3, including Llama 3.1's `llama3` RoPE scaling): the architecture as a DAG of IR ops over
Hugging Face weight names."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, Value, dtype_from_name
from pegainfer.ir.layers import LayerSlot, repeat_layers
from pegainfer.ir.step import AttentionInputs, declare_step_inputs
from pegainfer.models.blocks import (AttentionSpec, HeadShape, glu_activation, lm_head, pre_norm_layer,
                                     require_grouped_heads, rope_scaling)

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPE = "llama"


@dataclass(frozen=True)
class Config(HeadShape):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    pretraining_tp: int = 1
    torch_dtype: str = "bfloat16"


def check_config(config: Config) -> None:
    require_positive(config, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim")
    require_float_dtype(config.torch_dtype)
    glu_activation(config.hidden_act)
    rope_scaling(config.rope_scaling)
    require_grouped_heads(config.num_attention_heads, config.kv_heads)
    if config.pretraining_tp != 1:
        raise ConfigError(f"pretraining_tp {config.pretraining_tp} is not implemented (expected 1)")


def build_graph(config: Config) -> Graph:
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder("llama")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    embed = b.param("model.embed_tokens.weight", dtype, (config.vocab_size, config.hidden_size))
    hidden = b.embedding(input_ids, embed, name="embed")
    hidden = repeat_layers(b, "llama", ["decoder"] * config.num_hidden_layers, _layer(config), hidden, attention)
    return b.finish(lm_head(b, hidden, logits_indices, embed, config.vocab_size, config.rms_norm_eps,
                            config.tie_word_embeddings))


def _layer(config: Config):
    spec = AttentionSpec(hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.kv_heads,
                         head_dim=config.dims_per_head, theta=config.rope_theta,
                         scaling=rope_scaling(config.rope_scaling), qkv_bias=config.attention_bias,
                         o_bias=config.attention_bias)

    def layer(b: GraphBuilder, residual: Value, attention: AttentionInputs, slot: LayerSlot) -> Value:
        return pre_norm_layer(b, residual, attention, slot.index, spec, config.intermediate_size,
                              config.rms_norm_eps, glu_activation(config.hidden_act), mlp_bias=config.mlp_bias)
    return layer


TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": MODEL_TYPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}
