"""DeepSeek-V3 (and Kimi-K2, whose config.json names this architecture): DeepSeek-V2's decoder (models/deepseek_v2.py)
with its router's sigmoid scores: experts chosen by score plus the checkpoint's score correction bias, within the
`topk_group` best of `n_group` groups by their best two experts' sum; the chosen experts weighted by their unbiased
scores, renormalised when norm_topk_prob, times routed_scaling_factor. A DAG of IR ops over Hugging Face weight
names."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.ir import Graph, GraphBuilder, Value
from pegainfer.ir.dtypes import FP32
from pegainfer.models import deepseek_v2
from pegainfer.models.deepseek_v2 import Router

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
MODEL_TYPE = "deepseek_v3"


@dataclass(frozen=True)
class Config(deepseek_v2.Config):
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    rope_interleave: bool = True


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
