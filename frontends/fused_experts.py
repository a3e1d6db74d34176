"""Checkpoints that store a MoE layer's experts fused (a DAG file with FUSED_EXPERTS allows it): `<prefix>.experts.
gate_up_proj` [experts, 2 x intermediate, hidden] (each expert's gate rows, then its up rows) and `<prefix>.experts.
down_proj` [experts, hidden, intermediate], without a `.weight` suffix. Each expert's piece is listed under
transformers' per-expert name as a view of the fused tensor (its row range, its byte span), so that the graph's
stacked expert weights and the uploader's direct reads work unchanged."""

from dataclasses import replace

from pegainfer.errors import CheckpointError
from pegainfer.frontends.checkpoint import FLOAT_DTYPES, FP8_DTYPES, TensorInfo
from pegainfer.ir.dtypes import dtype_from_name

GATE_UP, DOWN = ".experts.gate_up_proj", ".experts.down_proj"


def split_fused_experts(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """`tensors` with each fused expert tensor replaced by its experts' per-expert views."""
    out = {}
    for name, info in tensors.items():
        if name.endswith(GATE_UP):
            out |= _views(name, info, name.removesuffix(GATE_UP), ("gate", "up"))
        elif name.endswith(DOWN):
            out |= _views(name, info, name.removesuffix(DOWN), ("down",))
        else:
            out[name] = info
    return out


def _views(name: str, info: TensorInfo, prefix: str, parts: tuple[str, ...]) -> dict[str, TensorInfo]:
    if len(info.shape) != 3 or info.shape[1] % len(parts):
        raise CheckpointError(f"{info.file}: fused expert tensor {name!r} has shape {list(info.shape)}, expected "
                              f"[experts, {' + '.join(f'{p} rows' for p in parts)}, in-features]")
    experts, rows, width = info.shape
    piece = rows // len(parts)
    known = info.offset >= 0 and info.dtype in (*FLOAT_DTYPES, *FP8_DTYPES)  # else read by name, not span
    item = dtype_from_name(info.dtype).itemsize if known else 0
    views = {}
    for e in range(experts):
        for i, part in enumerate(parts):
            first = e * rows + i * piece
            span = (info.offset + first * width * item, piece * width * item) if known else (-1, 0)
            views[f"{prefix}.experts.{e}.{part}_proj.weight"] = replace(
                info, shape=(piece, width), offset=span[0], nbytes=span[1], stored_name=info.stored_name or name,
                rows=(e, i * piece, (i + 1) * piece))
    return views
