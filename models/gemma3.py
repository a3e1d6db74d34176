"""Gemma 3 (text): RMSNorms that scale by 1 + weight, norms after attention and around the MLP, a GELU-tanh MLP,
embeddings scaled by sqrt(hidden), per-head q/k norms, attention scaled by query_pre_attn_scalar, and layers that
alternate sliding-window (local) attention, with a RoPE base of their own, and global attention. A DAG of IR ops
over Hugging Face weight names."""

from dataclasses import dataclass

import numpy as np

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, Value, dtype_from_name
from pegainfer.ir.layers import LayerSlot, repeat_layers
from pegainfer.ir.step import AttentionInputs, declare_step_inputs
from pegainfer.models.blocks import (AttentionSpec, gated_mlp, glu_activation, lm_head, require_grouped_heads,
                                     rope_scaling, self_attention)

ARCHITECTURES = ("Gemma3ForCausalLM",)
MODEL_TYPE = "gemma3_text"
WRAPPERS = {"Gemma3ForConditionalGeneration": "gemma3"}  # Gemma 3 at 4B and above: served by its text stack
# transformers' Gemma3TextConfig defaults for the sizes, which published text_configs leave out
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4}
FLOAT16_UNSUPPORTED = "its activations overflow float16 (vLLM refuses it too)"
SLIDING, FULL = "sliding_attention", "full_attention"
NORM_OFFSET = 1.0  # Gemma's RMSNorm scales by 1 + weight


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None  # transformers 5: one entry per layer type
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    sliding_window_pattern: int = 6
    layer_types: list | None = None
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = False
    tie_word_embeddings: bool = True
    torch_dtype: str = "bfloat16"

    def kinds(self) -> list[str]:
        """Every sliding_window_pattern-th layer is global, unless config.json lists the layer types."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return [FULL if (i + 1) % self.sliding_window_pattern == 0 else SLIDING
                for i in range(self.num_hidden_layers)]

    def rope(self, kind: str) -> tuple[float, tuple | None]:
        """(theta, scaling) of a layer type: global layers use rope_theta and rope_scaling, local ones their base."""
        if self.rope_parameters is not None and isinstance(self.rope_parameters.get(kind), dict):
            params = self.rope_parameters[kind]
            return float(params.get("rope_theta", self.rope_theta)), rope_scaling(params)
        if kind == FULL:
            return self.rope_theta, rope_scaling(self.rope_scaling)
        return self.rope_local_base_freq, None


def check_config(config: Config) -> None:
    require_positive(config, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                     "sliding_window_pattern", "query_pre_attn_scalar")
    require_float_dtype(config.torch_dtype)
    glu_activation(config.hidden_activation)
    require_grouped_heads(config.num_attention_heads, config.num_key_value_heads)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, key) is not None:
            raise ConfigError(f"{key} {getattr(config, key)!r} is not implemented (expected null)")
    if config.use_bidirectional_attention:
        raise ConfigError("use_bidirectional_attention true is not implemented (expected false)")
    kinds = config.kinds()
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= {SLIDING, FULL}:
        raise ConfigError(f"layer_types must list {config.num_hidden_layers} of {SLIDING!r} or {FULL!r}, "
                          f"found {config.layer_types!r}")
    for kind in set(kinds):
        config.rope(kind)


def build_graph(config: Config) -> Graph:
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder("gemma3")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    embed = b.param("model.embed_tokens.weight", dtype, (config.vocab_size, config.hidden_size))
    hidden = b.embedding(input_ids, embed, scale=_embedding_scale(config.hidden_size, dtype.np_dtype), name="embed")
    hidden = repeat_layers(b, "gemma3", config.kinds(), _layer(config), hidden, attention)
    return b.finish(lm_head(b, hidden, logits_indices, embed, config.vocab_size, config.rms_norm_eps,
                            config.tie_word_embeddings, norm_offset=NORM_OFFSET))


def _embedding_scale(hidden: int, storage: np.dtype) -> float:
    """sqrt(hidden), rounded to the weights' dtype as Hugging Face does (bf16: 34.0 for 1152, not 33.94)."""
    return float(np.float32(hidden ** 0.5).astype(storage).astype(np.float32))


def _layer(config: Config):
    def layer(b: GraphBuilder, residual: Value, attention: AttentionInputs, slot: LayerSlot) -> Value:
        theta, scaling = config.rope(slot.kind)
        spec = AttentionSpec(hidden=config.hidden_size, heads=config.num_attention_heads,
                             kv_heads=config.num_key_value_heads, head_dim=config.head_dim, theta=theta,
                             scaling=scaling, scale=config.query_pre_attn_scalar ** -0.5,
                             window=config.sliding_window if slot.kind == SLIDING else 0,
                             qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                             qk_norm_eps=config.rms_norm_eps, norm_offset=NORM_OFFSET)
        prefix = f"model.layers.{slot.index}"

        def norm(x: Value, name: str) -> Value:
            weight = b.param(f"{prefix}.{name}.weight", x.dtype, (config.hidden_size,))
            return b.rms_norm(x, weight, eps=config.rms_norm_eps, offset=NORM_OFFSET, name=name)

        attn = self_attention(b, norm(residual, "input_layernorm"), attention, f"{prefix}.self_attn",
                              f"kv.{slot.index}", spec)
        residual = b.add(residual, norm(attn, "post_attention_layernorm"), name="attn_residual")
        mlp = gated_mlp(b, norm(residual, "pre_feedforward_layernorm"), f"{prefix}.mlp", config.intermediate_size,
                        glu_activation(config.hidden_activation))
        return b.add(residual, norm(mlp, "post_feedforward_layernorm"), name="mlp_residual")
    return layer


TINY_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": MODEL_TYPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 6,
    "sliding_window_pattern": 2,
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}
