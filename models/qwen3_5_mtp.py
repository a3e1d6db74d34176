"""The multi-token-prediction head Qwen3.5 checkpoints carry (`mtp.*`, config.json's mtp_num_hidden_layers): the
next token's embedding and the model's last hidden state, each RMSNormed (pre_fc_norm_embedding, pre_fc_norm_hidden),
concatenated and projected back to the hidden size by `fc`, then full-attention decoder layers as the model's own
(`mtp.layers.<i>`) and a final norm, sharing the embedding and LM head. Its tensors are checked against this layout
at load (frontends/load.py) and kept, read lazily, for a speculative-decoding proposer."""

from collections.abc import Callable
from typing import TYPE_CHECKING

from pegainfer.ir import Graph, GraphBuilder, TensorType, dtype_from_name
from pegainfer.ir.layers import LayerSlot
from pegainfer.ir.step import declare_step_inputs

if TYPE_CHECKING:  # qwen3_5 imports this module
    from pegainfer.models.qwen3_5 import Config

FULL = "full_attention"
NORM_OFFSET = 1.0  # the head's norms scale by 1 + weight, as the model's


def head_graph(config: "Config", layer: Callable, embedding: str, head: str) -> Graph:
    """The head run as a drafter (runtime/drafters.py): the next token (its embedding the model's `embedding`) and
    the model's features, each normed, through fc, `layer` (the DAG file's full-attention layer under
    `mtp.layers`) once per MTP layer and the final norm; the model's LM head (`head`) gives the logits at the
    sampled rows. Outputs: those logits, and every token's normed output (what a further draft reads)."""
    dtype, hidden = dtype_from_name(config.torch_dtype), config.hidden_size
    b = GraphBuilder("qwen3_5_mtp")
    input_ids, attention, logits_indices = declare_step_inputs(b)
    features = b.input("features", dtype, ("tokens", hidden))

    def norm(x, name: str):
        weight = b.param(f"mtp.{name}.weight", dtype, (hidden,))
        return b.rms_norm(x, weight, eps=config.rms_norm_eps, offset=NORM_OFFSET, name=name)
    table = b.param(embedding, dtype, (config.vocab_size, hidden))
    embeds = b.embedding(input_ids, table, name="embed")
    both = b.concat(norm(embeds, "pre_fc_norm_embedding"), norm(features, "pre_fc_norm_hidden"), name="both")
    x = b.linear(both, b.param("mtp.fc.weight", dtype, (hidden, 2 * hidden)), name="fc")
    for index in range(config.mtp_num_hidden_layers):
        x = layer(b, x, attention, LayerSlot(FULL, str(index)))
    out = norm(x, "norm")
    rows = b.gather_rows(out, logits_indices, name="sampled_rows")
    lm_head = table if head == embedding else b.param(head, dtype, (config.vocab_size, hidden))  # tied
    return b.finish(b.linear(rows, lm_head, name="logits"), out)


def head_params(config: "Config", layer: Callable) -> dict[str, TensorType]:
    """The head's own checkpoint tensors by name (the embedding and LM head are the model's)."""
    graph = head_graph(config, layer, "model.embed_tokens.weight", "lm_head.weight")
    return {name: t for name, t in graph.checkpoint_params().items() if name.startswith("mtp.")}
