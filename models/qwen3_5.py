"""Qwen3.5 (dense): a hybrid of Gated DeltaNet linear-attention layers (models/delta_net.py) and full-attention
layers with a sigmoid output gate, q/k norms and partial rotary, in the pattern config.json's layer_types gives;
RMSNorms scale by 1 + weight. Text-only positions make its multimodal RoPE the ordinary one (its three position
components are equal). A DAG of IR ops over Hugging Face weight names."""

from collections.abc import Callable
from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, TensorType, Value, dtype_from_name
from pegainfer.ir.layers import LayerSlot, repeat_layers
from pegainfer.ir.step import AttentionInputs, declare_step_inputs
from pegainfer.models.blocks import (AttentionSpec, gated_mlp, glu_activation, lm_head, require_grouped_heads,
                                     self_attention)
from pegainfer.models.delta_net import DeltaNetSpec, check_delta_net, gated_delta_net
from pegainfer.models.qwen3_5_mtp import head_graph, head_params

ARCHITECTURES = ("Qwen3_5ForCausalLM",)
MODEL_TYPE = "qwen3_5_text"
WRAPPERS = {"Qwen3_5ForConditionalGeneration": "qwen3_5"}  # multimodal checkpoints served by their text stack
LINEAR, FULL = "linear_attention", "full_attention"
MTP_LAYERS_KEY = "mtp_num_hidden_layers"  # config.json's count of the MTP head's layers
NORM_OFFSET = 1.0  # Qwen3.5's RMSNorms scale by 1 + weight (the output gate's norm excepted)


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int | None = None  # the dense MLP's (the MoE form has none)
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    full_attention_interval: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: dict | None = None
    partial_rotary_factor: float | None = None  # transformers 4.x's spelling; 5.x's is in rope_parameters
    rope_scaling: dict | None = None
    attn_output_gate: bool = True
    mtp_num_hidden_layers: int = 0  # the multi-token-prediction head's layers (models/qwen3_5_mtp.py)
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"

    def kinds(self) -> list[str]:
        """Every full_attention_interval-th layer is full attention, unless config.json lists the layer types."""
        if self.layer_types is not None:
            return list(self.layer_types)
        return [FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR for i in range(self.num_hidden_layers)]

    @property
    def rotary_dim(self) -> int:
        factor = (self.rope_parameters or {}).get("partial_rotary_factor", self.partial_rotary_factor)
        return int(self.head_dim * (0.25 if factor is None else factor))

    def delta_net(self) -> DeltaNetSpec:
        return DeltaNetSpec(hidden=self.hidden_size, key_heads=self.linear_num_key_heads,
                            value_heads=self.linear_num_value_heads, key_dim=self.linear_key_head_dim,
                            value_dim=self.linear_value_head_dim, conv_width=self.linear_conv_kernel_dim,
                            eps=self.rms_norm_eps)


def check_config(config: Config) -> None:
    if config.intermediate_size is None:
        raise ConfigError("missing key 'intermediate_size' (int)")
    check_layers(config)


def check_layers(config: Config) -> None:
    """What the dense and MoE forms share: the mixers, the rotary and the layer pattern."""
    require_positive(config, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "linear_conv_kernel_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "full_attention_interval")
    require_float_dtype(config.torch_dtype)
    if config.hidden_act != "silu":
        raise ConfigError(f"hidden_act {config.hidden_act!r} is not implemented for Qwen3.5 (expected 'silu')")
    if config.rope_scaling is not None:
        raise ConfigError(f"rope_scaling {config.rope_scaling!r} is not implemented for Qwen3.5 (expected the "
                          f"default rope_type)")
    rotary = config.rotary_dim
    if not (0 < rotary <= config.head_dim and rotary % 2 == 0):
        raise ConfigError(f"partial_rotary_factor must rotate an even count of 1 .. {config.head_dim} dims, "
                          f"found {rotary}")
    require_grouped_heads(config.num_attention_heads, config.num_key_value_heads)
    check_delta_net(config.delta_net())
    kinds = config.kinds()
    if len(kinds) != config.num_hidden_layers or not set(kinds) <= {LINEAR, FULL}:
        raise ConfigError(f"layer_types must list {config.num_hidden_layers} of {LINEAR!r} or {FULL!r}, "
                          f"found {config.layer_types!r}")


# The layer's MLP: (builder, the normed input, the layer's prefix) -> its output.
MlpBlock = Callable[[GraphBuilder, Value, str], Value]


def build_graph(config: Config, name: str = "qwen3_5", mlp: MlpBlock | None = None) -> Graph:
    """The model's graph; `mlp` replaces every layer's gated MLP (the MoE form's sparse block)."""
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder(name)
    input_ids, attention, logits_indices = declare_step_inputs(b, recurrent=True)
    embed = b.param("model.embed_tokens.weight", dtype, (config.vocab_size, config.hidden_size))
    hidden = b.embedding(input_ids, embed, name="embed")
    hidden = repeat_layers(b, name, config.kinds(), _layer(config, mlp or _dense_mlp(config)), hidden, attention)
    return b.finish(lm_head(b, hidden, logits_indices, embed, config.vocab_size, config.rms_norm_eps,
                            config.tie_word_embeddings, norm_offset=NORM_OFFSET))


def _dense_mlp(config: Config) -> MlpBlock:
    return lambda b, x, prefix: gated_mlp(b, x, f"{prefix}.mlp", config.intermediate_size,
                                         glu_activation(config.hidden_act))


def _layer(config: Config, mlp: MlpBlock, root: str = "model.layers"):
    spec = AttentionSpec(hidden=config.hidden_size, heads=config.num_attention_heads,
                         kv_heads=config.num_key_value_heads, head_dim=config.head_dim, theta=config.rope_theta,
                         qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm_eps=config.rms_norm_eps,
                         norm_offset=NORM_OFFSET, rotary_dim=config.rotary_dim if config.rotary_dim < config.head_dim
                         else 0, output_gate=config.attn_output_gate)

    def layer(b: GraphBuilder, residual: Value, attention: AttentionInputs, slot: LayerSlot) -> Value:
        prefix = f"{root}.{slot.index}"

        def norm(x: Value, name: str, label: str) -> Value:
            weight = b.param(f"{prefix}.{name}.weight", x.dtype, (config.hidden_size,))
            return b.rms_norm(x, weight, eps=config.rms_norm_eps, offset=NORM_OFFSET, name=label)

        x = norm(residual, "input_layernorm", "mixer_norm")
        if slot.kind == LINEAR:
            mixed = gated_delta_net(b, x, attention, f"{prefix}.linear_attn", f"recurrent.{slot.index}",
                                    config.delta_net())
        else:
            mixed = self_attention(b, x, attention, f"{prefix}.self_attn", f"kv.{slot.index}", spec)
        residual = b.add(residual, mixed, name="mixer_residual")
        out = mlp(b, norm(residual, "post_attention_layernorm", "mlp_norm"), prefix)
        return b.add(residual, out, name="mlp_residual")
    return layer


def mtp_params(config: Config) -> dict[str, TensorType]:
    """The tensors of the checkpoint's MTP head (models/qwen3_5_mtp.py), by name; none without MTP layers."""
    if not config.mtp_num_hidden_layers:
        return {}
    return head_params(config, _layer(config, _dense_mlp(config), root="mtp.layers"))


def mtp_graph(config: Config, mlp: MlpBlock | None = None) -> Graph:
    """The MTP head as a drafter over this model's features, its embedding and LM head the model's."""
    layer = _layer(config, mlp or _dense_mlp(config), root="mtp.layers")
    embed = "model.embed_tokens.weight"
    return head_graph(config, layer, embed, embed if config.tie_word_embeddings else "lm_head.weight")


TINY_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": MODEL_TYPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "tie_word_embeddings": True,
    "max_position_embeddings": 2048,
}
