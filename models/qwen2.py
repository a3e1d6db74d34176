"""Qwen2 and Qwen2.5: Llama's layer with biases on the q/k/v projections, and sliding-window attention on the
layers from `max_window_layers` on when `use_sliding_window` is set. A DAG of IR ops over Hugging Face weight names."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, Value, dtype_from_name
from pegainfer.ir.layers import LayerSlot, repeat_layers
from pegainfer.ir.step import AttentionInputs, declare_step_inputs
from pegainfer.models.blocks import (AttentionSpec, HeadShape, glu_activation, lm_head, pre_norm_layer,
                                     require_grouped_heads, rope_scaling)

ARCHITECTURES = ("Qwen2ForCausalLM",)
MODEL_TYPE = "qwen2"
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Config(HeadShape):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None  # transformers reads it when present; hidden_size // heads otherwise
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list | None = None
    torch_dtype: str = "bfloat16"

    def kinds(self) -> list[str]:
        """Hugging Face's layer types: sliding from max_window_layers on, when a window is in use."""
        if self.layer_types is not None:
            return list(self.layer_types)
        window = self.use_sliding_window and self.sliding_window is not None
        return [SLIDING if window and i >= self.max_window_layers else FULL for i in range(self.num_hidden_layers)]


def check_config(config: Config) -> None:
    require_positive(config, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window")
    require_float_dtype(config.torch_dtype)
    glu_activation(config.hidden_act)
    rope_scaling(config.rope_scaling)
    require_grouped_heads(config.num_attention_heads, config.kv_heads)
    kinds = config.kinds()
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= {SLIDING, FULL}:
        raise ConfigError(f"layer_types must list {config.num_hidden_layers} of {SLIDING!r} or {FULL!r}, "
                          f"found {config.layer_types!r}")
    if SLIDING in kinds and not (config.use_sliding_window and config.sliding_window):
        raise ConfigError("layer_types names sliding_attention layers but use_sliding_window is false or "
                          "sliding_window is null")


def build_graph(config: Config) -> Graph:
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder("qwen2")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    embed = b.param("model.embed_tokens.weight", dtype, (config.vocab_size, config.hidden_size))
    hidden = b.embedding(input_ids, embed, name="embed")
    hidden = repeat_layers(b, "qwen2", config.kinds(), _layer(config), hidden, attention)
    return b.finish(lm_head(b, hidden, logits_indices, embed, config.vocab_size, config.rms_norm_eps,
                            config.tie_word_embeddings))


def _layer(config: Config):
    def layer(b: GraphBuilder, residual: Value, attention: AttentionInputs, slot: LayerSlot) -> Value:
        spec = AttentionSpec(hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.kv_heads,
                             head_dim=config.dims_per_head, theta=config.rope_theta,
                             scaling=rope_scaling(config.rope_scaling), qkv_bias=True,
                             window=config.sliding_window if slot.kind == SLIDING else 0)
        return pre_norm_layer(b, residual, attention, slot.index, spec, config.intermediate_size,
                              config.rms_norm_eps, glu_activation(config.hidden_act))
    return layer


TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": MODEL_TYPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "max_position_embeddings": 2048,
}
