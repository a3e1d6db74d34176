"""Building blocks the DAG files share: weight declaration, RoPE settings from config.json, grouped-query
self-attention over the paged KV cache, the gated MLP, the pre-norm decoder layer, and the final norm with the LM
head. Plain functions of IR
ops; each DAG file says which it uses and how (this module declares no architecture)."""

from dataclasses import dataclass
from typing import Any

from pegainfer.errors import ConfigError
from pegainfer.ir import DType, GraphBuilder, Value
from pegainfer.ir.step import AttentionInputs, kv_cache_shape

GLU_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class HeadShape:
    """For a DAG file's Config (a dataclass with hidden_size, num_attention_heads, num_key_value_heads and head_dim,
    the last two optional): the counts as transformers derives them when config.json leaves them out."""

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dims_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def optional(**attrs: Any) -> dict[str, Any]:
    """Op attributes left out at their defaults (0, None), so graphs that do not use them print as before."""
    return {key: value for key, value in attrs.items() if value}


def weights(b: GraphBuilder, prefix: str, dtype: DType):
    """`weight(name, *shape)`: the param `<prefix>.<name>`."""
    return lambda name, *shape: b.param(f"{prefix}.{name}", dtype, shape)


def rope_scaling(scaling: dict[str, Any] | None) -> tuple | None:
    """Hugging Face's rope_scaling (or a layer type's rope_parameters) as the rope op's `scaling` attribute."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    keys = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if kind not in keys:
        raise ConfigError(f"rope_scaling type {kind!r} is not implemented (expected one of {', '.join(keys)})")
    missing = [key for key in keys[kind] if not isinstance(scaling.get(key), (int, float))]
    if missing:
        raise ConfigError(f"rope_scaling of type {kind!r} needs numbers {missing}, found {scaling!r}")
    if kind == "default":
        return None
    return ("by_wavelength" if kind == "llama3" else kind, *(float(scaling[key]) for key in keys[kind]))


def glu_activation(name: str) -> str:
    if name not in GLU_ACTIVATIONS:
        raise ConfigError(f"activation {name!r} is not implemented (expected one of {', '.join(GLU_ACTIVATIONS)})")
    return GLU_ACTIVATIONS[name]


def require_grouped_heads(heads: int, kv_heads: int) -> None:
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads {heads} must be a multiple of num_key_value_heads {kv_heads}")


@dataclass(frozen=True)
class AttentionSpec:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    theta: float
    scaling: tuple | None = None  # the rope op's scaling attribute
    scale: float | None = None  # softmax scale; head_dim ** -0.5 when None
    window: int = 0  # sliding window in tokens; 0: none
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm_eps: float | None = None  # per-head RMSNorm of q and k before RoPE (q_norm, k_norm) when set
    norm_offset: float = 0.0  # 1.0 for norms that scale by 1 + weight
    rotary_dim: int = 0  # the leading dims of each head RoPE rotates (partial rotary); 0: all
    output_gate: bool = False  # q_proj also gives a gate per head, after its q: output * sigmoid(gate)
    input_width: int = 0  # the projections' input width where it is not `hidden` (a drafter's 2 x hidden)


def self_attention(b: GraphBuilder, x: Value, attention: AttentionInputs, prefix: str, cache: str,
                   spec: AttentionSpec) -> Value:
    """Q/K/V projections, optional q/k norms, RoPE, the paged KV write, attention and o_proj. `prefix` names the
    weights (`model.layers.{layer}.self_attn`), `cache` the KV states (`kv.{layer}`)."""
    weight = weights(b, prefix, x.dtype)

    def project(name: str, heads: int) -> Value:
        w = weight(f"{name}.weight", heads * spec.head_dim, spec.input_width or spec.hidden)  # before its bias
        bias = [weight(f"{name}.bias", heads * spec.head_dim)] if spec.qkv_bias else []
        flat = b.linear(x, w, *bias, name=name)
        return b.reshape(flat, shape=("tokens", heads, spec.head_dim), name=f"{name}_heads")

    def norm_and_rope(value: Value, norm: str) -> Value:
        if spec.qk_norm_eps is not None:
            value = b.rms_norm(value, weight(f"{norm}.weight", spec.head_dim), eps=spec.qk_norm_eps, name=norm,
                               **optional(offset=spec.norm_offset))
        return b.rope(value, attention.positions, theta=spec.theta, name=f"{norm[0]}_rope",
                      **optional(scaling=spec.scaling, rotary_dim=spec.rotary_dim))

    q, gate = _gated_query(b, x, prefix, spec) if spec.output_gate else (project("q_proj", spec.heads), None)
    q = norm_and_rope(q, "q_norm")
    k = norm_and_rope(project("k_proj", spec.kv_heads), "k_norm")
    v = project("v_proj", spec.kv_heads)
    k_cache = b.state(f"{cache}.k", x.dtype, kv_cache_shape(spec.kv_heads, spec.head_dim))
    v_cache = b.state(f"{cache}.v", x.dtype, kv_cache_shape(spec.kv_heads, spec.head_dim))
    k_cache, v_cache = b.kv_write(k_cache, v_cache, k, v, attention.slot_mapping, name="kv_write")
    out = b.paged_attention(q, k_cache, v_cache, attention.block_tables, attention.seq_starts, attention.query_lens,
                            attention.context_lens, scale=spec.scale or spec.head_dim ** -0.5, name="attention",
                            **optional(window=spec.window))
    out = b.reshape(out, shape=("tokens", spec.heads * spec.head_dim), name="attention_flat")
    if gate is not None:
        out = b.mul(out, b.sigmoid(gate, name="output_gate"), name="gated_attention")
    o_bias = [weight("o_proj.bias", spec.hidden)] if spec.o_bias else []
    return b.linear(out, weight("o_proj.weight", spec.hidden, spec.heads * spec.head_dim), *o_bias, name="o_proj")


def _gated_query(b: GraphBuilder, x: Value, prefix: str, spec: AttentionSpec) -> tuple[Value, Value]:
    """q_proj's output holds each head's q then its gate; the loader regroups the weight's rows so that the GEMM
    gives all q heads then all gates, two column ranges of one output. (q [tokens, heads, head_dim], gate)."""
    if spec.qkv_bias:
        raise ConfigError("an attention output gate with q/k/v biases is not implemented")
    width, dim = spec.heads * spec.head_dim, spec.head_dim
    rows = [(2 * h * dim + part * dim, 2 * h * dim + (part + 1) * dim) for part in (0, 1) for h in range(spec.heads)]
    w = b.row_ranges_param(f"{prefix}.q_proj.weight.grouped", f"{prefix}.q_proj.weight", x.dtype,
                           (2 * width, spec.hidden), rows)
    q, gate = b.split(b.linear(x, w, name="q_proj"), sizes=(width, width), name="q_and_gate")
    return b.reshape(q, shape=("tokens", spec.heads, dim), name="q_proj_heads"), gate


def routed_experts(b: GraphBuilder, x: Value, prefix: str, experts: int, k: int, intermediate: int,
                   normalize: bool, act: str) -> Value:
    """A sparse MoE block: the router's softmax over `experts`, the top `k` (their weights renormalised when
    `normalize`) and the chosen experts' gated MLPs, each expert's weights stacked at load under Hugging Face's
    names `<prefix>.experts.<e>.{gate,up,down}_proj.weight`."""
    hidden = x.shape[-1]
    router = b.linear(x, b.param(f"{prefix}.gate.weight", x.dtype, (experts, hidden)), name="router")
    weights, ids = b.moe_route(router, k=k, normalize=normalize, name="route")
    gate_up, down = stacked_experts(b, x, prefix, experts, intermediate)
    return b.moe_experts(x, weights, ids, gate_up, down, experts=experts, act=act, name="experts")


def stacked_experts(b: GraphBuilder, x: Value, prefix: str, experts: int, intermediate: int) -> tuple[Value, Value]:
    """The experts' gate/up and down weights, each stacked at load from Hugging Face's per-expert names
    `<prefix>.experts.<e>.{gate,up,down}_proj.weight` (ir/ops/moe.py's layout)."""
    hidden = x.shape[-1]
    gate_up = b.stacked_param(f"{prefix}.experts.gate_up_proj.weight",
                              [f"{prefix}.experts.{e}.{p}_proj.weight" for e in range(experts) for p in ("gate", "up")],
                              x.dtype, (intermediate, hidden))
    down = b.stacked_param(f"{prefix}.experts.down_proj.weight",
                           [f"{prefix}.experts.{e}.down_proj.weight" for e in range(experts)], x.dtype,
                           (hidden, intermediate))
    return gate_up, down


def gated_mlp(b: GraphBuilder, x: Value, prefix: str, intermediate: int, act: str, bias: bool = False) -> Value:
    """down(act(gate(x)) * up(x)) over `<prefix>.{gate,up,down}_proj`."""
    hidden = x.shape[-1]
    weight = weights(b, prefix, x.dtype)

    def linear(name: str, value: Value, out: int, inp: int) -> Value:
        extra = [weight(f"{name}.bias", out)] if bias else []
        return b.linear(value, weight(f"{name}.weight", out, inp), *extra, name=name.removesuffix("_proj"))

    gate, up = linear("gate_proj", x, intermediate, hidden), linear("up_proj", x, intermediate, hidden)
    gated = b.mul(b.op(act, gate, name="gate_act"), up, name="gated")
    return linear("down_proj", gated, hidden, intermediate)


def pre_norm_layer(b: GraphBuilder, residual: Value, attention: AttentionInputs, index: int, spec: AttentionSpec,
                   intermediate: int, eps: float, act: str, mlp_bias: bool = False) -> Value:
    """The decoder layer Llama, Mistral and Qwen2 share: x + attention(norm(x)), then + MLP(norm(.)), under
    Hugging Face's names (input_layernorm, self_attn, post_attention_layernorm, mlp)."""
    prefix = f"model.layers.{index}"

    def norm(x: Value, name: str, label: str) -> Value:
        return b.rms_norm(x, b.param(f"{prefix}.{name}.weight", x.dtype, (spec.hidden,)), eps=eps, name=label)

    attn = self_attention(b, norm(residual, "input_layernorm", "attn_norm"), attention, f"{prefix}.self_attn",
                          f"kv.{index}", spec)
    residual = b.add(residual, attn, name="attn_residual")
    mlp = gated_mlp(b, norm(residual, "post_attention_layernorm", "mlp_norm"), f"{prefix}.mlp", intermediate, act,
                    bias=mlp_bias)
    return b.add(residual, mlp, name="mlp_residual")


def lm_head(b: GraphBuilder, hidden: Value, logits_indices: Value, embed: Value, vocab: int, eps: float,
            tied: bool, norm_offset: float = 0.0) -> Value:
    """The rows whose logits the step returns, the final RMSNorm, and the LM head (the embedding when tied)."""
    hidden = b.gather_rows(hidden, logits_indices, name="sampled_rows")
    hidden = b.rms_norm(hidden, b.param("model.norm.weight", hidden.dtype, (hidden.shape[-1],)), eps=eps,
                        name="final_norm", **optional(offset=norm_offset))
    head = embed if tied else b.param("lm_head.weight", hidden.dtype, (vocab, hidden.shape[-1]))
    return b.linear(hidden, head, name="logits")
