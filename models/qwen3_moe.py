"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a sparse MoE block in place of the MLP: a router
(softmax over the experts, the top k, their weights renormalised when norm_topk_prob) and the chosen experts'
gated MLPs. Layers in mlp_only_layers, or off the decoder_sparse_step, keep a dense MLP. A DAG of IR ops over
Hugging Face weight names; the experts' weights are stacked at load into one tensor per layer and projection."""

from dataclasses import dataclass, field

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, Value, dtype_from_name
from pegainfer.ir.layers import LayerSlot, repeat_layers
from pegainfer.ir.step import AttentionInputs, declare_step_inputs
from pegainfer.models.blocks import (AttentionSpec, HeadShape, gated_mlp, glu_activation, lm_head,
                                     require_grouped_heads, routed_experts, self_attention)

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPE = "qwen3_moe"
SPARSE, DENSE = "moe", "dense"


@dataclass(frozen=True)
class Config(HeadShape):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts_per_tok: int
    num_experts: int | None = None  # transformers 5 writes num_local_experts
    num_local_experts: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    use_sliding_window: bool = False
    torch_dtype: str = "bfloat16"

    @property
    def experts(self) -> int:
        return self.num_experts if self.num_experts is not None else self.num_local_experts or 0

    def kinds(self) -> list[str]:
        return [SPARSE if i not in self.mlp_only_layers and self.experts > 0 and (i + 1) % self.decoder_sparse_step == 0
                else DENSE for i in range(self.num_hidden_layers)]


def check_config(config: Config) -> None:
    require_positive(config, "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts_per_tok",
                     "decoder_sparse_step", "head_dim")
    require_float_dtype(config.torch_dtype)
    glu_activation(config.hidden_act)
    require_grouped_heads(config.num_attention_heads, config.num_key_value_heads)
    if config.experts < 1:
        raise ConfigError(f"num_experts must be at least 1, found {config.experts}")
    if config.num_experts_per_tok > config.experts:
        raise ConfigError(f"num_experts_per_tok {config.num_experts_per_tok} exceeds num_experts {config.experts}")
    if config.rope_scaling is not None:
        raise ConfigError(f"rope_scaling {config.rope_scaling!r} is not implemented for Qwen3-MoE (expected null)")
    if config.use_sliding_window:
        raise ConfigError("use_sliding_window true is not implemented for Qwen3-MoE (expected false)")


def build_graph(config: Config) -> Graph:
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder("qwen3_moe")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    embed = b.param("model.embed_tokens.weight", dtype, (config.vocab_size, config.hidden_size))
    hidden = b.embedding(input_ids, embed, name="embed")
    hidden = repeat_layers(b, "qwen3_moe", config.kinds(), _layer(config), hidden, attention)
    return b.finish(lm_head(b, hidden, logits_indices, embed, config.vocab_size, config.rms_norm_eps,
                            config.tie_word_embeddings))


def _layer(config: Config):
    spec = AttentionSpec(hidden=config.hidden_size, heads=config.num_attention_heads,
                         kv_heads=config.num_key_value_heads, head_dim=config.dims_per_head, theta=config.rope_theta,
                         qkv_bias=config.attention_bias, o_bias=config.attention_bias,
                         qk_norm_eps=config.rms_norm_eps)
    act = glu_activation(config.hidden_act)

    def layer(b: GraphBuilder, residual: Value, attention: AttentionInputs, slot: LayerSlot) -> Value:
        prefix = f"model.layers.{slot.index}"

        def norm(x: Value, name: str, label: str) -> Value:
            weight = b.param(f"{prefix}.{name}.weight", x.dtype, (config.hidden_size,))
            return b.rms_norm(x, weight, eps=config.rms_norm_eps, name=label)

        attn = self_attention(b, norm(residual, "input_layernorm", "attn_norm"), attention, f"{prefix}.self_attn",
                              f"kv.{slot.index}", spec)
        residual = b.add(residual, attn, name="attn_residual")
        normed = norm(residual, "post_attention_layernorm", "mlp_norm")
        if slot.kind == SPARSE:
            mlp = routed_experts(b, normed, f"{prefix}.mlp", config.experts, config.num_experts_per_tok,
                                 config.moe_intermediate_size, config.norm_topk_prob, act)
        else:
            mlp = gated_mlp(b, normed, f"{prefix}.mlp", config.intermediate_size, act)
        return b.add(residual, mlp, name="mlp_residual")
    return layer


TINY_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": MODEL_TYPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}
