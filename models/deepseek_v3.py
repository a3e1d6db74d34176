"""DeepSeek-V3 (and Kimi-K2, whose config.json names this architecture): DeepSeek-V2's decoder (models/deepseek_v2.py)
with its router's sigmoid scores: experts chosen by score plus the checkpoint's score correction bias, within the
`topk_group` best of `n_group` groups by their best two experts' sum; the chosen experts weighted by their unbiased
scores, renormalised when norm_topk_prob, times routed_scaling_factor. A DAG of IR ops over Hugging Face weight
names."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.ir import Graph, GraphBuilder, TensorType, Value, dtype_from_name
from pegainfer.ir.dtypes import FP32
from pegainfer.ir.layers import LayerSlot
from pegainfer.ir.step import EMBED_GATE, declare_step_inputs
from pegainfer.models import deepseek_v2
from pegainfer.models.deepseek_v2 import Router

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
MODEL_TYPE = "deepseek_v3"
MTP_LAYERS_KEY = "num_nextn_predict_layers"  # config.json's count of the multi-token-prediction layers


@dataclass(frozen=True)
class Config(deepseek_v2.Config):
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    rope_interleave: bool = True
    num_nextn_predict_layers: int = 0


def check_config(config: Config) -> None:
    deepseek_v2.check_common(config)
    if config.topk_method != "noaux_tc" or config.scoring_func != "sigmoid":
        raise ConfigError(f"topk_method {config.topk_method!r} with scoring_func {config.scoring_func!r} is not "
                          f"implemented for DeepSeek-V3 (expected noaux_tc with sigmoid)")
    deepseek_v2.check_groups(config)
    if (config.n_group or 1) > 1 and config.n_routed_experts // config.n_group < 2:
        raise ConfigError(f"n_group {config.n_group} leaves fewer than the two experts a group's score sums")


def build_graph(config: Config) -> Graph:
    return deepseek_v2.build_model(config, "deepseek_v3", route_sigmoid(config))


def mtp_prefix(config: Config) -> str:
    """Where the checkpoint keeps its multi-token-prediction layer: the layer after the last decoder layer."""
    return f"model.layers.{config.num_hidden_layers}."


def mtp_params(config: Config) -> dict[str, TensorType]:
    """The first MTP layer's tensors, by name (none without one); a checkpoint's further ones are not run."""
    return mtp_graph(config).checkpoint_params() if config.num_nextn_predict_layers else {}


def mtp_graph(config: Config) -> Graph:
    """The first MTP layer as a drafter (runtime/drafters.py) over the model's final hidden states: the next
    token's embedding (dropped at position 0, as trained) and those features, each normed (enorm, hnorm), through
    eh_proj and a decoder layer of the model's own kind; its shared head's norm and LM head give the logits at the
    sampled rows. Outputs: those logits, and every token's output before that norm (a further draft's input)."""
    dtype, hidden, prefix = dtype_from_name(config.torch_dtype), config.hidden_size, mtp_prefix(config)
    b = GraphBuilder("deepseek_v3_mtp")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    features = b.input("features", dtype, ("tokens", hidden))
    gate = b.input(EMBED_GATE, dtype, ("tokens", 1))

    def norm(x: Value, name: str) -> Value:
        weight = b.param(f"{prefix}{name}.weight", dtype, (hidden,))
        return b.rms_norm(x, weight, eps=config.rms_norm_eps, name=name.replace(".", "_"))
    embeds = b.embedding(input_ids, b.param(f"{prefix}embed_tokens.weight", dtype, (config.vocab_size, hidden)),
                         name="embed")
    both = b.concat(norm(b.scale_rows(embeds, gate, name="gated_embed"), "enorm"), norm(features, "hnorm"),
                    name="both")
    x = b.linear(both, b.param(f"{prefix}eh_proj.weight", dtype, (hidden, 2 * hidden)), name="eh_proj")
    layer = config.num_hidden_layers
    kind = deepseek_v2.SPARSE if layer >= config.first_k_dense_replace else deepseek_v2.DENSE
    x = deepseek_v2._layer(config, route_sigmoid(config))(b, x, attention, LayerSlot(kind, str(layer)))
    rows = b.gather_rows(x, logits_indices, name="sampled_rows")
    head = b.param(f"{prefix}shared_head.head.weight", dtype, (config.vocab_size, hidden))
    return b.finish(b.linear(norm(rows, "shared_head.norm"), head, name="logits"), x)


def route_sigmoid(config: Config) -> Router:
    grouped = (config.n_group or 1) > 1
    groups = dict(groups=config.n_group, topk_group=config.topk_group, group_score="top2") if grouped else {}

    def route(b: GraphBuilder, logits: Value, prefix: str) -> tuple[Value, Value]:
        bias = b.param(f"{prefix}.gate.e_score_correction_bias", FP32, (config.n_routed_experts,))
        return b.moe_route(logits, bias, k=config.num_experts_per_tok, normalize=config.norm_topk_prob,
                           scoring="sigmoid", name="route", **groups, **deepseek_v2._scale(config))
    return route


TINY_CONFIG = {
    **deepseek_v2.TINY_CONFIG,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": MODEL_TYPE,
    "q_lora_rank": 24,
    "n_shared_experts": 1,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_interleave": True,
}
