"""The multi-token-prediction head Qwen3.5 checkpoints carry (`mtp.*`, config.json's mtp_num_hidden_layers): the
next token's embedding and the model's last hidden state, each RMSNormed (pre_fc_norm_embedding, pre_fc_norm_hidden),
concatenated and projected back to the hidden size by `fc`, then full-attention decoder layers as the model's own
(`mtp.layers.<i>`) and a final norm, sharing the embedding and LM head. Its tensors are checked against this layout
at load (frontends/load.py) and kept, read lazily, for a speculative-decoding proposer."""

from collections.abc import Callable
from typing import TYPE_CHECKING

from pegainfer.ir import GraphBuilder, TensorType, dtype_from_name
from pegainfer.ir.layers import LayerSlot
from pegainfer.ir.step import declare_step_inputs

if TYPE_CHECKING:  # qwen3_5 imports this module
    from pegainfer.models.qwen3_5 import Config

FULL = "full_attention"
NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")


def head_params(config: "Config", layer: Callable) -> dict[str, TensorType]:
    """The head's checkpoint tensors by name: `layer` (the DAG file's full-attention layer under `mtp.layers`)
    traced once per MTP layer, plus fc and the three norms."""
    dtype, hidden = dtype_from_name(config.torch_dtype), config.hidden_size
    b = GraphBuilder("qwen3_5_mtp")
    _, attention, _ = declare_step_inputs(b, recurrent=True)
    x = b.input("hidden_states", dtype, ("tokens", hidden))
    for index in range(config.mtp_num_hidden_layers):
        x = layer(b, x, attention, LayerSlot(FULL, str(index)))
    params = b.graph.checkpoint_params()
    params["mtp.fc.weight"] = TensorType(dtype, (hidden, 2 * hidden))
    params |= {f"mtp.{norm}.weight": TensorType(dtype, (hidden,)) for norm in NORMS}
    return params
