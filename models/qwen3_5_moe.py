"""Qwen3.5-MoE: Qwen3.5's hybrid layers (models/qwen3_5.py) with a sparse MoE block in every layer's place of the
MLP: the router's softmax top k, renormalised, over the routed experts, plus a shared expert whose output a sigmoid
gate of one column scales. Published checkpoints store each layer's experts fused ([experts, 2 x moe_intermediate,
hidden] gate_up_proj, [experts, hidden, moe_intermediate] down_proj); FUSED_EXPERTS lets the loader read them as
transformers' per-expert names. A DAG of IR ops over Hugging Face weight names."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_positive
from pegainfer.ir import Graph, GraphBuilder, TensorType, Value
from pegainfer.models import qwen3_5
from pegainfer.models.blocks import gated_mlp, glu_activation, routed_experts
from pegainfer.models.qwen3_5_mtp import head_params

MTP_LAYERS_KEY = qwen3_5.MTP_LAYERS_KEY
ARCHITECTURES = ("Qwen3_5MoeForCausalLM",)
MODEL_TYPE = "qwen3_5_moe_text"
WRAPPERS = {"Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe"}  # multimodal checkpoints served by their text stack
FUSED_EXPERTS = True


@dataclass(frozen=True)
class Config(qwen3_5.Config):
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512


def check_config(config: Config) -> None:
    qwen3_5.check_layers(config)
    require_positive(config, "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size")
    if config.num_experts_per_tok > config.num_experts:
        raise ConfigError(f"num_experts_per_tok {config.num_experts_per_tok} exceeds num_experts {config.num_experts}")


def build_graph(config: Config) -> Graph:
    return qwen3_5.build_graph(config, "qwen3_5_moe", _sparse_block(config))


def mtp_params(config: Config) -> dict[str, TensorType]:
    """The tensors of the checkpoint's MTP head, its layer's MLP the sparse block (per-expert or fused); none
    without MTP layers."""
    if not config.mtp_num_hidden_layers:
        return {}
    return head_params(config, qwen3_5._layer(config, _sparse_block(config), root="mtp.layers"))


def mtp_graph(config: Config) -> Graph:
    return qwen3_5.mtp_graph(config, _sparse_block(config))


def _sparse_block(config: Config):
    act = glu_activation(config.hidden_act)

    def block(b: GraphBuilder, x: Value, prefix: str) -> Value:
        routed = routed_experts(b, x, f"{prefix}.mlp", config.num_experts, config.num_experts_per_tok,
                                config.moe_intermediate_size, True, act)
        shared = gated_mlp(b, x, f"{prefix}.mlp.shared_expert", config.shared_expert_intermediate_size, act)
        gate = b.param(f"{prefix}.mlp.shared_expert_gate.weight", x.dtype, (1, config.hidden_size))
        weight = b.sigmoid(b.linear(x, gate, name="shared_gate"), name="shared_weight")
        return b.add(routed, b.scale_rows(shared, weight, name="shared_gated"), name="moe_out")
    return block


TINY_CONFIG = {
    **{k: v for k, v in qwen3_5.TINY_CONFIG.items() if k != "intermediate_size"},
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": MODEL_TYPE,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
