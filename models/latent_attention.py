"""Multi-head latent attention as a token mixer: the query (straight, or through a low-rank q_a / q_b pair with its
norm), one compressed latent and one shared rope key a token (kv_a_proj_with_mqa), the latent's norm, the latent
cache's write and attention through kv_b_proj (ir/ops/latent_attention.py), the output projection. Plain IR ops over
Hugging Face's weight names (`<prefix>.q_a_proj`, ...), and YaRN's rope settings, for DAG files to use."""

import math
from dataclasses import dataclass
from typing import Any

from pegainfer.errors import ConfigError
from pegainfer.ir import GraphBuilder, Value
from pegainfer.ir.step import AttentionInputs, kv_cache_shape
from pegainfer.models.blocks import optional, rope_scaling, weights


@dataclass(frozen=True)
class LatentSpec:
    hidden: int
    heads: int
    q_rank: int | None  # q_lora_rank: None for a plain q_proj
    kv_rank: int  # the latent's width (kv_lora_rank)
    nope_dim: int  # per head, the key part without rotation (qk_nope_head_dim)
    rope_dim: int  # per head and shared key, the rotated part (qk_rope_head_dim)
    value_dim: int  # per head (v_head_dim)
    theta: float
    eps: float  # the q_a and kv_a norms'
    scaling: tuple | None = None  # the rope op's
    scale: float = 1.0  # softmax scale
    interleaved: bool = True  # rope pairs dims 2i, 2i + 1
    bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj biases (attention_bias)

    @property
    def cache_width(self) -> int:
        """Values a token of the latent cache holds: its latent, then its rope key."""
        return self.kv_rank + self.rope_dim


def latent_self_attention(b: GraphBuilder, x: Value, attention: AttentionInputs, prefix: str, cache: str,
                          spec: LatentSpec) -> Value:
    """`prefix` names the weights (`model.layers.{layer}.self_attn`), `cache` the latent state (`kv.{layer}`)."""
    weight = weights(b, prefix, x.dtype)
    head_dim = spec.nope_dim + spec.rope_dim

    def linear(name: str, value: Value, out: int, inp: int, bias: bool = False) -> Value:
        extra = [weight(f"{name}.bias", out)] if bias else []
        return b.linear(value, weight(f"{name}.weight", out, inp), *extra, name=name)

    def rope(value: Value, name: str) -> Value:
        return b.rope(value, attention.positions, theta=spec.theta, name=name,
                      **optional(scaling=spec.scaling, interleaved=spec.interleaved))

    if spec.q_rank is None:
        q = linear("q_proj", x, spec.heads * head_dim, spec.hidden)
    else:
        q = linear("q_a_proj", x, spec.q_rank, spec.hidden, spec.bias)
        q = b.rms_norm(q, weight("q_a_layernorm.weight", spec.q_rank), eps=spec.eps, name="q_a_norm")
        q = linear("q_b_proj", q, spec.heads * head_dim, spec.q_rank)
    q = b.reshape(q, shape=("tokens", spec.heads, head_dim), name="q_heads")
    q_nope, q_rot = b.split(q, sizes=(spec.nope_dim, spec.rope_dim), name="q_parts")
    q_rot = rope(q_rot, "q_rope")
    compressed = linear("kv_a_proj_with_mqa", x, spec.cache_width, spec.hidden, spec.bias)
    latent, k_rot = b.split(compressed, sizes=(spec.kv_rank, spec.rope_dim), name="kv_parts")
    latent = b.rms_norm(latent, weight("kv_a_layernorm.weight", spec.kv_rank), eps=spec.eps, name="kv_a_norm")
    k_rot = rope(b.reshape(k_rot, shape=("tokens", 1, spec.rope_dim), name="k_rot_head"), "k_rope")
    k_rot = b.reshape(k_rot, shape=("tokens", spec.rope_dim), name="k_rot_flat")
    state = b.state(cache, x.dtype, kv_cache_shape(1, spec.cache_width))
    state = b.latent_write(state, latent, k_rot, attention.slot_mapping, name="latent_write")
    kv_b = weight("kv_b_proj.weight", spec.heads * (spec.nope_dim + spec.value_dim), spec.kv_rank)
    out = b.mla_attention(q_nope, q_rot, state, kv_b, attention.block_tables, attention.seq_starts,
                          attention.query_lens, attention.context_lens, scale=spec.scale, name="attention")
    out = b.reshape(out, shape=("tokens", spec.heads * spec.value_dim), name="attention_flat")
    return linear("o_proj", out, spec.hidden, spec.heads * spec.value_dim, spec.bias)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def latent_rope(scaling: dict[str, Any] | None, rope_dim: int, theta: float) -> tuple | None:
    """config.json's rope_scaling as the rope op's attribute: the kinds blocks.rope_scaling knows, and yarn, whose
    ramp between dims is found as transformers finds it (its correction range from beta_fast and beta_slow)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind != "yarn":
        return rope_scaling(scaling)
    factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
    if not isinstance(factor, (int, float)) or not isinstance(original, (int, float)):
        raise ConfigError(f"rope_scaling of type 'yarn' needs numbers factor and original_max_position_embeddings, "
                          f"found {scaling!r}")
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else yarn_mscale(factor, 1.0))
    return ("yarn", float(factor), float(max(low, 0)), float(min(high, rope_dim - 1)), float(attention_factor))


def softmax_scale(scaling: dict[str, Any] | None, head_dim: int) -> float:
    """head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared (DeepSeek's long-context scale)."""
    scale = head_dim ** -0.5
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        mscale_all = scaling.get("mscale_all_dim", 0)
        if mscale_all:
            scale *= yarn_mscale(scaling["factor"], mscale_all) ** 2
    return scale
