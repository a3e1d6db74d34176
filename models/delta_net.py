"""The Gated DeltaNet token mixer, a linear-attention layer with a fixed-size state per sequence: projections to
q, k, v (through a short causal convolution), a gate z, a decay input a and a write strength b; the gated delta
rule over per-head states (ir/ops/linear_attention.py); an RMSNorm per head gated by silu(z); the output
projection. Plain IR ops over Hugging Face's weight names (`<prefix>.in_proj_qkv`, ...), for DAG files to use."""

from dataclasses import dataclass

from pegainfer.errors import ConfigError
from pegainfer.ir import GraphBuilder, Value
from pegainfer.ir.dtypes import FP32
from pegainfer.ir.step import AttentionInputs, recurrent_state_shape
from pegainfer.models.blocks import weights


@dataclass(frozen=True)
class DeltaNetSpec:
    hidden: int
    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    conv_width: int
    eps: float  # the gated output norm's

    @property
    def conv_channels(self) -> int:
        """q, k and v side by side, the convolution's channels (in that order, as in_proj_qkv's rows)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def check_delta_net(spec: DeltaNetSpec) -> None:
    if spec.value_heads % spec.key_heads:
        raise ConfigError(f"linear_num_value_heads {spec.value_heads} must be a multiple of linear_num_key_heads "
                          f"{spec.key_heads}")
    if spec.conv_width < 2:
        raise ConfigError(f"linear_conv_kernel_dim must be at least 2, found {spec.conv_width}")


def gated_delta_net(b: GraphBuilder, x: Value, attention: AttentionInputs, prefix: str, state: str,
                    spec: DeltaNetSpec) -> Value:
    """`prefix` names the weights (`model.layers.{layer}.linear_attn`), `state` the layer's state pools
    (`<state>.conv` in the model's dtype, `<state>.delta` in float32: the recurrence accumulates into it)."""
    assert attention.state_slots is not None, "a recurrent layer needs the step's state slots"
    weight = weights(b, prefix, x.dtype)
    keys, values = spec.key_heads * spec.key_dim, spec.value_heads * spec.value_dim
    sequences = (attention.state_slots, attention.seq_starts, attention.query_lens, attention.context_lens)
    mixed = b.linear(x, weight("in_proj_qkv.weight", spec.conv_channels, spec.hidden), name="in_proj_qkv")
    z = b.linear(x, weight("in_proj_z.weight", values, spec.hidden), name="in_proj_z")
    beta_in = b.linear(x, weight("in_proj_b.weight", spec.value_heads, spec.hidden), name="in_proj_b")
    decay_in = b.linear(x, weight("in_proj_a.weight", spec.value_heads, spec.hidden), name="in_proj_a")
    conv_w = b.reshape(weight("conv1d.weight", spec.conv_channels, 1, spec.conv_width),
                       shape=(spec.conv_channels, spec.conv_width), name="conv_taps")
    conv_state = b.state(f"{state}.conv", x.dtype, recurrent_state_shape(spec.conv_channels, spec.conv_width - 1))
    _, mixed = b.causal_conv1d(mixed, conv_w, conv_state, *sequences, activation="silu", name="conv")
    q, k, v = b.split(mixed, sizes=(keys, keys, values), name="qkv")
    q = b.reshape(q, shape=("tokens", spec.key_heads, spec.key_dim), name="q_heads")
    k = b.reshape(k, shape=("tokens", spec.key_heads, spec.key_dim), name="k_heads")
    v = b.reshape(v, shape=("tokens", spec.value_heads, spec.value_dim), name="v_heads")
    g = b.decay_gate(decay_in, weight("A_log", spec.value_heads), weight("dt_bias", spec.value_heads), name="decay")
    beta = b.sigmoid(beta_in, name="beta")
    delta_state = b.state(f"{state}.delta", FP32, recurrent_state_shape(spec.value_heads, spec.key_dim,
                                                                        spec.value_dim))
    _, out = b.gated_delta_rule(q, k, v, g, beta, delta_state, *sequences, scale=spec.key_dim ** -0.5,
                                name="delta_rule")
    out = b.rms_norm(out, weight("norm.weight", spec.value_dim), eps=spec.eps, name="out_norm")
    z = b.reshape(z, shape=("tokens", spec.value_heads, spec.value_dim), name="z_heads")
    out = b.mul(out, b.silu(z, name="z_act"), name="gated_out")
    out = b.reshape(out, shape=("tokens", values), name="delta_flat")
    return b.linear(out, weight("out_proj.weight", spec.hidden, values), name="out_proj")
