"""Mixture of experts: routing each token to its top-k experts (softmax or sigmoid scores, optionally within the best
groups of experts), and applying the chosen experts' gated MLPs.

Expert weights are stacked along rows, expert e's block after expert e-1's (a derived param the loader stacks from
the checkpoint's per-expert tensors): gate_up is [experts * 2I, H], expert e's rows 2Ie .. 2Ie + I its gate
projection and the next I its up projection; down is [experts * H, I]. Under expert parallelism a rank holds only
some of the experts the router picks among: E' local ones from `first_expert` on, whose weights are [E' * 2I, H] and
[E' * H, I]; pairs routed to other experts contribute nothing (another rank's sum has them). FP8 experts (an FP8
checkpoint's) are float8 e4m3 with float32 scales stacked the same way: each of the 2E projections of gate_up (and E
of down) keeps its own blocks of `block` rows x columns, cut short at its edges, as the checkpoint stores them.
"""

import numpy as np

from pegainfer.ir.dtypes import FP32, INT32
from pegainfer.ir.ops.basic import _gelu_tanh, _silu
from pegainfer.ir.ops.quantize import dequantize, scale_shape
from pegainfer.ir.registry import GEMM, ROW_REDUCTION, expect, register_op
from pegainfer.ir.types import TensorType

ACTIVATIONS = {"silu": _silu, "gelu_tanh": _gelu_tanh}


SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")  # a group's score: its best expert's, or its best two's sum


def _infer_route(logits: TensorType, *bias: TensorType, k: int, normalize: bool, scoring: str = "softmax",
                 groups: int = 0, topk_group: int = 0, group_score: str = "max",
                 scale: float = 1.0) -> tuple[TensorType, TensorType]:
    expect(logits.rank == 2 and logits.dtype.is_float and isinstance(logits.shape[1], int),
           f"moe_route: router logits must be float [tokens, experts], found {logits}")
    experts = logits.shape[1]
    expect(isinstance(k, int) and 0 < k <= experts, f"moe_route: k must be in 1..{experts}, found {k!r}")
    expect(isinstance(normalize, bool), f"moe_route: normalize must be a bool, found {normalize!r}")
    expect(scoring in SCORINGS, f"moe_route: scoring must be one of {SCORINGS}, found {scoring!r}")
    expect(len(bias) <= 1 and all(b.rank == 1 and b.shape[0] == experts and b.dtype.is_float for b in bias),
           f"moe_route: the optional score bias must be float [{experts}], found {list(map(str, bias))}")
    if groups:
        expect(isinstance(groups, int) and experts % groups == 0 and 0 < topk_group <= groups
               and k <= topk_group * (experts // groups) and group_score in GROUP_SCORES,
               f"moe_route: {groups} groups must divide {experts} experts, topk_group in 1..{groups} keep at least "
               f"k={k} experts, group_score one of {GROUP_SCORES}; found topk_group {topk_group!r}, "
               f"group_score {group_score!r}")
    expect(scale > 0, f"moe_route: scale must be positive, found {scale!r}")
    return TensorType(logits.dtype, (logits.shape[0], k)), TensorType(INT32, (logits.shape[0], k))


def _route(logits: np.ndarray, *bias: np.ndarray, k: int, normalize: bool, scoring: str = "softmax",
           groups: int = 0, topk_group: int = 0, group_score: str = "max",
           scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Scores (softmax over the experts, or each expert's sigmoid); the experts chosen by score plus the optional
    bias, within the `topk_group` best of `groups` groups when grouped; the k best (descending, ties to the lower
    index) weighted by their scores, renormalised to sum to 1 when `normalize`, times `scale`."""
    if scoring == "softmax":
        scores = np.exp(logits - logits.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    choice = scores + bias[0] if bias else scores
    if groups:
        grouped = choice.reshape(len(choice), groups, -1)
        ranked = -np.sort(-grouped, axis=-1)
        group_scores = ranked[..., 0] if group_score == "max" else ranked[..., :2].sum(axis=-1)
        best = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
        kept = np.zeros(group_scores.shape, bool)
        np.put_along_axis(kept, best, True, axis=-1)
        choice = np.where(np.repeat(kept, grouped.shape[-1], axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return (weights * np.float32(scale)).astype(np.float32), ids.astype(np.int32)


def _infer_experts(x: TensorType, weights: TensorType, ids: TensorType, gate_up: TensorType, down: TensorType,
                   *scales: TensorType, experts: int, act: str, block: list[int] | None = None,
                   first_expert: int = 0) -> TensorType:
    expect(x.rank == 2 and x.dtype.is_float, f"moe_experts: input must be float [tokens, hidden], found {x}")
    expect(weights.rank == 2 and weights.shape[0] == x.shape[0] and weights.dtype.is_float
           and ids.shape == weights.shape and not ids.dtype.is_float,
           f"moe_experts: routing must be float weights and integer ids, both [{x.shape[0]}, k], found {weights} "
           f"and {ids}")
    expect(act in ACTIVATIONS, f"moe_experts: act must be one of {sorted(ACTIVATIONS)}, found {act!r}")
    hidden = x.shape[1]
    local = held_experts(down, hidden)
    expect(isinstance(first_expert, int) and local and 0 <= first_expert <= experts - local,
           f"moe_experts: down must hold whole experts [E' * {hidden}, I], E' of the {experts} routed from "
           f"first_expert {first_expert!r} on; found {down}")
    inter = down.shape[1]
    expect(gate_up.shape == (local * 2 * inter, hidden),
           f"moe_experts: gate_up must be [{local} * 2 * {inter}, {hidden}], found {gate_up}")
    fp8 = gate_up.dtype.name.startswith("f8")
    expect(fp8 == down.dtype.name.startswith("f8") == bool(scales) == (block is not None),
           f"moe_experts: FP8 experts take both weights in FP8, their two scales and a block; found {gate_up}, "
           f"{down}, {len(scales)} scales, block {block}")
    if fp8:
        expect(len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
               f"moe_experts: block must be two positive sizes, found {block}")
        for name, scale, projections, shape in (("gate_up", scales[0], 2 * local, (inter, hidden)),
                                                ("down", scales[1], local, (hidden, inter))):
            rows, cols = scale_shape(shape, tuple(block))
            wanted = TensorType(FP32, (projections * rows, cols))
            expect(scale == wanted, f"moe_experts: {name}'s scales must be {wanted} ({projections} projections of "
                                    f"{list(shape)} in blocks of {block}), found {scale}")
    return x


def held_experts(down: TensorType, hidden: int) -> int:
    """The experts a node's stacked down weight holds (all of them, or a rank's under expert parallelism); 0 when
    it holds no whole number of them."""
    rows = down.shape[0] if down.rank == 2 else 0
    return rows // hidden if isinstance(rows, int) and rows % hidden == 0 else 0


def stacked_dequantize(q: np.ndarray, scale: np.ndarray, projections: int, block: list[int]) -> np.ndarray:
    """Stacked FP8 projections to float32, each of the `projections` by its own blocks."""
    rows = q.shape[0] // projections
    per = scale.shape[0] // projections
    return np.concatenate([dequantize(q[p * rows:(p + 1) * rows], scale[p * per:(p + 1) * per],
                                      block=tuple(block), dtype="f32") for p in range(projections)])


def _experts(x: np.ndarray, weights: np.ndarray, ids: np.ndarray, gate_up: np.ndarray, down: np.ndarray,
             *scales: np.ndarray, experts: int, act: str, block: list[int] | None = None,
             first_expert: int = 0) -> np.ndarray:
    """sum over the k chosen experts e of weight * down_e(act(gate_e x) * up_e x), per token; of the experts held
    (first_expert onwards) only."""
    hidden = x.shape[1]
    local = down.shape[0] // hidden
    if scales:  # dequantized to the activations' dtype, as a dequantize op rounds them
        gate_up = stacked_dequantize(gate_up, scales[0], 2 * local, block).astype(x.dtype)
        down = stacked_dequantize(down, scales[1], local, block).astype(x.dtype)
    inter = down.shape[1]
    gate_up, down = gate_up.reshape(local, 2 * inter, hidden), down.reshape(local, hidden, inter)
    out = np.zeros_like(x, dtype=np.float32)
    for expert in np.unique(ids):
        if not first_expert <= expert < first_expert + local:
            continue  # another rank's expert
        rows, slots = np.nonzero(ids == expert)  # a token picks an expert at most once: rows are distinct
        projected = x[rows] @ gate_up[expert - first_expert].T
        activated = ACTIVATIONS[act](projected[:, :inter]) * projected[:, inter:]
        out[rows] += weights[rows, slots, None] * (activated @ down[expert - first_expert].T)
    return out


register_op("moe_route", _infer_route, _route, ROW_REDUCTION)
register_op("moe_experts", _infer_experts, _experts, GEMM)
