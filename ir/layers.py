"""Decoder layers of more than one kind (sliding-window and global attention, MoE and dense MLPs) in repeated
bodies. A model whose layers are all alike is one body run once per layer. Otherwise the layer kinds are cut into
segments, each a period of kinds repeated: five local layers then one global, over and over, become one body of six
layers run depth // 6 times, plus a body for the layers left over. Compile time then grows with the period, never
with depth, and every layer's differences (window, RoPE base) stay compile-time constants of its kernels."""

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pegainfer.ir.builder import GraphBuilder, Value
from pegainfer.ir.graph import layer_placeholder
from pegainfer.ir.step import AttentionInputs, declare_attention_inputs


@dataclass(frozen=True)
class Segment:
    start: int  # the first layer's index
    period: int  # layers in the body
    count: int  # repetitions of the body


@dataclass(frozen=True)
class LayerSlot:
    """One decoder layer of a body: its kind, and the placeholder its weight and cache names use for its index."""
    kind: Hashable
    index: str  # `{layer}` or `{layer*P+O}`: substitute into names such as f"model.layers.{slot.index}.mlp"


LayerFn = Callable[[GraphBuilder, Value, AttentionInputs, LayerSlot], Value]


def plan_segments(kinds: Sequence[Hashable]) -> list[Segment]:
    """Covers the layers with segments of fewest body layers in all (then fewest segments): dynamic programming
    over where the next segment starts, each trying every period repeated as often as the kinds allow."""
    total = len(kinds)
    best: list[tuple[int, int, list[Segment]]] = [(0, 0, [])] * (total + 1)
    for start in range(total - 1, -1, -1):
        options = []
        for period in range(1, total - start + 1):
            count = 1
            while start + (count + 1) * period <= total and \
                    kinds[start + count * period: start + (count + 1) * period] == kinds[start: start + period]:
                count += 1
            layers, segments, rest = best[start + period * count]
            options.append((layers + period, segments + 1, [Segment(start, period, count), *rest]))
        best[start] = min(options, key=lambda option: option[:2])
    return best[0][2]


def repeat_layers(b: GraphBuilder, name: str, kinds: Sequence[Hashable], layer: LayerFn, hidden: Value,
                  attention: AttentionInputs) -> Value:
    """Runs `layer` once per entry of `kinds` over the residual stream `hidden`; returns the last layer's output.
    Bodies are named `<name>_layer` (a single kind) or `<name>_layers<start>`."""
    segments = plan_segments(list(kinds))
    for segment in segments:
        single = len(segments) == 1 and segment.period == 1
        body = GraphBuilder(f"{name}_layer" if single else f"{name}_layers{segment.start}", body=True)
        h = body.input("hidden", hidden.dtype, hidden.shape)
        body_attention = declare_attention_inputs(body, recurrent=attention.state_slots is not None)
        for j in range(segment.period):
            slot = LayerSlot(kinds[segment.start + j], layer_placeholder(segment.period, segment.start + j))
            h = layer(body, h, body_attention, slot)
        (hidden,) = b.repeat(body.finish(h), segment.count, carried=[hidden], invariant=attention.as_list(),
                             layers=segment.period)
    return hidden
