"""DeepSeek-V2 (and V2-Lite): multi-head latent attention (models/latent_attention.py) in every layer, a dense MLP in
the first `first_k_dense_replace` layers and a MoE block after them: the router's softmax top k (greedy, or within
the `topk_group` best of `n_group` groups by their best expert), weights times routed_scaling_factor, plus
`n_shared_experts` experts every token takes, as one gated MLP. A DAG of IR ops over Hugging Face weight names."""

from dataclasses import dataclass, field
from typing import Any, Callable

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, Value, dtype_from_name
from pegainfer.ir.layers import LayerSlot, repeat_layers
from pegainfer.ir.step import AttentionInputs, declare_step_inputs
from pegainfer.models.blocks import gated_mlp, glu_activation, lm_head, stacked_experts
from pegainfer.models.latent_attention import LatentSpec, latent_rope, latent_self_attention, softmax_scale

ARCHITECTURES = ("DeepseekV2ForCausalLM",)
MODEL_TYPE = "deepseek_v2"
SPARSE, DENSE = "moe", "dense"
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts_per_tok: int
    n_routed_experts: int
    q_lora_rank: int | None = None
    n_shared_experts: int | None = None
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    mlp_layer_types: list = field(default_factory=list)  # transformers 5's spelling of the dense / sparse pattern

    def kinds(self) -> list[str]:
        if self.mlp_layer_types:
            return [SPARSE if kind == "sparse" else DENSE for kind in self.mlp_layer_types]
        return [DENSE if i < self.first_k_dense_replace else SPARSE for i in range(self.num_hidden_layers)]


def check_config(config: Config) -> None:
    check_common(config)
    if config.topk_method not in TOPK_METHODS:
        raise ConfigError(f"topk_method {config.topk_method!r} is not implemented for DeepSeek-V2 (expected one of "
                          f"{', '.join(TOPK_METHODS)})")
    if config.scoring_func != "softmax":
        raise ConfigError(f"scoring_func {config.scoring_func!r} is not implemented for DeepSeek-V2 (expected "
                          f"softmax)")
    if config.norm_topk_prob:
        raise ConfigError("norm_topk_prob true is not implemented for DeepSeek-V2 (transformers' reference ignores "
                          "it; expected false)")
    if config.topk_method == "group_limited_greedy":
        check_groups(config)


def check_common(config: Any) -> None:
    """What V2 and V3 share: sizes, the dtype, the layer pattern, the experts' counts, rope."""
    require_positive(config, "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "num_experts_per_tok", "n_routed_experts", "q_lora_rank")
    require_float_dtype(config.torch_dtype)
    glu_activation(config.hidden_act)
    if config.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim must be even, found {config.qk_rope_head_dim}")
    if config.moe_layer_freq != 1:
        raise ConfigError(f"moe_layer_freq {config.moe_layer_freq} is not implemented (expected 1)")
    if config.mlp_layer_types and len(config.mlp_layer_types) != config.num_hidden_layers:
        raise ConfigError(f"mlp_layer_types names {len(config.mlp_layer_types)} layers, expected "
                          f"{config.num_hidden_layers}")
    if config.num_experts_per_tok > config.n_routed_experts:
        raise ConfigError(f"num_experts_per_tok {config.num_experts_per_tok} exceeds n_routed_experts "
                          f"{config.n_routed_experts}")
    latent_rope(config.rope_scaling, config.qk_rope_head_dim, config.rope_theta)


def check_groups(config: Any) -> None:
    groups, kept = config.n_group or 1, config.topk_group or 1
    if config.n_routed_experts % groups or not 0 < kept <= groups:
        raise ConfigError(f"n_group {groups} must divide n_routed_experts {config.n_routed_experts}, and topk_group "
                          f"{kept} be in 1..{groups}")
    if config.num_experts_per_tok > kept * (config.n_routed_experts // groups):
        raise ConfigError(f"num_experts_per_tok {config.num_experts_per_tok} exceeds the {kept} groups' "
                          f"{kept * (config.n_routed_experts // groups)} experts that topk_group keeps")


def build_graph(config: Config) -> Graph:
    return build_model(config, "deepseek_v2", route_softmax(config))


Router = Callable[[GraphBuilder, Value, str], tuple[Value, Value]]


def route_softmax(config: Config) -> Router:
    grouped = config.topk_method == "group_limited_greedy" and (config.n_group or 1) > 1
    groups = dict(groups=config.n_group, topk_group=config.topk_group) if grouped else {}

    def route(b: GraphBuilder, logits: Value, prefix: str) -> tuple[Value, Value]:
        return b.moe_route(logits, k=config.num_experts_per_tok, normalize=False, name="route",
                           **groups, **_scale(config))
    return route


def _scale(config: Any) -> dict[str, float]:
    return {"scale": config.routed_scaling_factor} if config.routed_scaling_factor != 1.0 else {}


def build_model(config: Any, name: str, route: Router) -> Graph:
    """The decoder of V2 and V3, their MoE blocks routed by `route`."""
    dtype = dtype_from_name(config.torch_dtype)
    b = GraphBuilder(name)
    input_ids, attention, logits_indices = declare_step_inputs(b)
    embed = b.param("model.embed_tokens.weight", dtype, (config.vocab_size, config.hidden_size))
    hidden = b.embedding(input_ids, embed, name="embed")
    hidden = repeat_layers(b, name, config.kinds(), _layer(config, route), hidden, attention)
    return b.finish(lm_head(b, hidden, logits_indices, embed, config.vocab_size, config.rms_norm_eps,
                            config.tie_word_embeddings))


def latent_spec(config: Any, interleaved: bool = True) -> LatentSpec:
    return LatentSpec(hidden=config.hidden_size, heads=config.num_attention_heads, q_rank=config.q_lora_rank,
                      kv_rank=config.kv_lora_rank, nope_dim=config.qk_nope_head_dim,
                      rope_dim=config.qk_rope_head_dim, value_dim=config.v_head_dim, theta=config.rope_theta,
                      eps=config.rms_norm_eps,
                      scaling=latent_rope(config.rope_scaling, config.qk_rope_head_dim, config.rope_theta),
                      scale=softmax_scale(config.rope_scaling, config.qk_nope_head_dim + config.qk_rope_head_dim),
                      interleaved=interleaved, bias=config.attention_bias)


def _layer(config: Any, route: Router):
    spec = latent_spec(config, getattr(config, "rope_interleave", True))
    act = glu_activation(config.hidden_act)

    def layer(b: GraphBuilder, residual: Value, attention: AttentionInputs, slot: LayerSlot) -> Value:
        prefix = f"model.layers.{slot.index}"

        def norm(x: Value, name: str, label: str) -> Value:
            weight = b.param(f"{prefix}.{name}.weight", x.dtype, (config.hidden_size,))
            return b.rms_norm(x, weight, eps=config.rms_norm_eps, name=label)

        attn = latent_self_attention(b, norm(residual, "input_layernorm", "attn_norm"), attention,
                                     f"{prefix}.self_attn", f"kv.{slot.index}", spec)
        residual = b.add(residual, attn, name="attn_residual")
        normed = norm(residual, "post_attention_layernorm", "mlp_norm")
        if slot.kind == SPARSE:
            mlp = _moe(b, normed, f"{prefix}.mlp", config, route, act)
        else:
            mlp = gated_mlp(b, normed, f"{prefix}.mlp", config.intermediate_size, act)
        return b.add(residual, mlp, name="mlp_residual")
    return layer


def _moe(b: GraphBuilder, x: Value, prefix: str, config: Any, route: Router, act: str) -> Value:
    experts = config.n_routed_experts
    router = b.linear(x, b.param(f"{prefix}.gate.weight", x.dtype, (experts, config.hidden_size)), name="router",
                      dtype="f32")  # float32 logits, as transformers computes them: near ties pick the same experts
    weights, ids = route(b, router, prefix)
    gate_up, down = stacked_experts(b, x, prefix, experts, config.moe_intermediate_size)
    routed = b.moe_experts(x, weights, ids, gate_up, down, experts=experts, act=act, name="experts")
    if not config.n_shared_experts:
        return routed
    shared = gated_mlp(b, x, f"{prefix}.shared_experts", config.moe_intermediate_size * config.n_shared_experts,
                       act)
    return b.add(routed, shared, name="moe_out")


TINY_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": MODEL_TYPE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "topk_method": "greedy",
    "routed_scaling_factor": 1.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}
