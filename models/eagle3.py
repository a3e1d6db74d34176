"""EAGLE-3 draft heads as published (LlamaForCausalLMEagle3 checkpoints: `fc`, one `midlayer` decoder layer, `norm`,
a draft-vocabulary `lm_head` and its `d2t` map to target ids), for speculative decoding (runtime/drafters.py).

The head reads the target's residual stream entering three of its layers (frontends/features.py), projected from
3 x hidden to hidden by `fc`; its layer normalises the next token's embedding (input_layernorm) and that hidden state
(hidden_norm), attends over both side by side (q/k/v take 2 x hidden), adds the hidden state back and runs its MLP.
Its output before the final norm is what the next draft step reads instead of the target's, so there are two
graphs over the same weights and KV cache: `first` (the target's features, through fc) and `next` (its own)."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.frontends.config import require_float_dtype, require_positive
from pegainfer.ir import Graph, GraphBuilder, dtype_from_name
from pegainfer.ir.step import declare_step_inputs
from pegainfer.models.blocks import (AttentionSpec, HeadShape, gated_mlp, glu_activation, require_grouped_heads,
                                     rope_scaling, self_attention)

DRAFTER_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
EMBEDDING = "model.embed_tokens.weight"  # the target's, under its own name: heads are trained on it
HEAD_TENSORS = ("d2t", "t2d")  # vocabulary maps, read apart from the graph's weights


@dataclass(frozen=True)
class Config(HeadShape):
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_hidden_layers: int = 1
    draft_vocab_size: int | None = None
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    hidden_act: str = "silu"
    eagle_config: dict | None = None
    torch_dtype: str = "bfloat16"

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def target_hidden(self) -> int:
        return self.target_hidden_size or self.hidden_size


def check_config(config: Config) -> None:
    require_positive(config, "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "vocab_size", "draft_vocab_size")
    require_float_dtype(config.torch_dtype)
    glu_activation(config.hidden_act)
    rope_scaling(config.rope_scaling)
    require_grouped_heads(config.num_attention_heads, config.kv_heads)
    if config.num_hidden_layers != 1:
        raise ConfigError(f"an EAGLE-3 head of {config.num_hidden_layers} layers is not implemented (expected 1)")


def aux_layers(config: Config, target_layers: int) -> list[int]:
    """The target layers whose input the head reads: its eagle_config's, else 2, L // 2 and L - 3 (as trained)."""
    given = (config.eagle_config or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = list(given) if given else [2, target_layers // 2, target_layers - 3]
    if len(layers) != 3 or not all(isinstance(n, int) and 0 <= n < target_layers for n in layers):
        raise ConfigError(f"EAGLE-3 reads the input of three target layers within 0..{target_layers - 1}, found "
                          f"{layers}")
    return layers


def build_graphs(config: Config) -> tuple[Graph, Graph]:
    """(first, next): the head over the target's features [tokens, 3 x target hidden], and over its own output
    [tokens, hidden]. Outputs: draft-vocabulary logits at the sampled rows, and every token's output before the
    final norm."""
    return _graph(config, first=True), _graph(config, first=False)


def _graph(config: Config, first: bool) -> Graph:
    dtype, hidden = dtype_from_name(config.torch_dtype), config.hidden_size
    b = GraphBuilder("eagle3_first" if first else "eagle3_next")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    width = 3 * config.target_hidden if first else hidden
    features = b.input("features", dtype, ("tokens", width))
    if first:
        features = b.linear(features, b.param("fc.weight", dtype, (hidden, width)), name="fc")
    embeds = b.embedding(input_ids, b.param(EMBEDDING, dtype, (config.vocab_size, hidden)), name="embed")
    eps = config.rms_norm_eps

    def norm(x, weight: str, label: str):
        return b.rms_norm(x, b.param(weight, dtype, (hidden,)), eps=eps, name=label)
    both = b.concat(norm(embeds, "midlayer.input_layernorm.weight", "embed_norm"),
                    norm(features, "midlayer.hidden_norm.weight", "hidden_norm"), name="embeds_and_hidden")
    spec = AttentionSpec(hidden=hidden, heads=config.num_attention_heads, kv_heads=config.kv_heads,
                         head_dim=config.dims_per_head, theta=config.rope_theta,
                         scaling=rope_scaling(config.rope_scaling), input_width=2 * hidden)
    attended = self_attention(b, both, attention, "midlayer.self_attn", "kv.0", spec)
    residual = b.add(features, attended, name="attn_residual")
    mlp = gated_mlp(b, norm(residual, "midlayer.post_attention_layernorm.weight", "mlp_norm"), "midlayer.mlp",
                    config.intermediate_size, glu_activation(config.hidden_act))
    out = b.add(residual, mlp, name="mlp_residual")
    rows = b.gather_rows(out, logits_indices, name="sampled_rows")
    logits = b.linear(norm(rows, "norm.weight", "final_norm"),
                      b.param("lm_head.weight", dtype, (config.draft_vocab, hidden)), name="logits")
    return b.finish(logits, out)
