"""Planning the rope/KV-write kernel (q/k norms, RoPE on q and k, the paged KV write): head_rows, a program per
(token, head), for decode steps of up to 64 sequences; token_rows, a program per token, for larger steps and
prompt chunks (of a full rotary)."""

from pegainfer.backends.planning import static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, VariantSpec
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.errors import PegainferError
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.step import uploaded

ROPE_HEAD_ROWS = 64  # up to this many tokens the rope/KV-write launch runs a program per (token, head); past it a
# program per token (a decode step of 256 sequences on an H100: 10.25 against 10.51 ms)


def plan_rope_kv_write(graph: Graph, node: Node) -> KernelSpec:
    inner = list(node.attrs["nodes"])
    produced = {out: n for n in inner for out in n.outputs}
    write = next(n for n in inner if n.op == "kv_write")
    k_cache, v_cache, k_final, v_heads, slots, *scales = write.inputs
    k_scale, v_scale = scales or (None, None)  # an FP8 cache's
    ropes = [n for n in inner if n.op == "rope"]
    k_rope = produced.get(k_final)
    q_ropes = [r for r in ropes if r is not k_rope]
    if k_rope is None or k_rope.op != "rope" or len(q_ropes) != 1 or len(inner) not in (3, 5):
        raise PegainferError(f"kernel {node.name}: the rope/KV-write template needs rope on q and k before the "
                             f"write, found {' + '.join(n.op for n in inner)}")
    q_rope = q_ropes[0]
    if q_rope.attrs != k_rope.attrs:
        raise PegainferError(f"kernel {node.name}: the rope/KV-write template needs one RoPE for q and k, found "
                             f"{q_rope.attrs} and {k_rope.attrs}")
    q_norm, k_norm = produced.get(q_rope.inputs[0]), produced.get(k_rope.inputs[0])
    if q_norm is not None and k_norm is not None and q_norm.attrs != k_norm.attrs:
        raise PegainferError(f"kernel {node.name}: q and k norms differ ({q_norm.attrs}, {k_norm.attrs})")
    norm = q_norm is not None and k_norm is not None
    types = graph.value_types()
    q_heads = q_norm.inputs[0] if norm else q_rope.inputs[0]
    k_heads = k_norm.inputs[0] if norm else k_rope.inputs[0]
    heads, head_dim = types[q_heads].shape[1], types[q_heads].shape[2]
    kv_heads = types[k_cache].shape[2]
    p = Params(types | {q_rope.outputs[0]: q_rope.output_types[0]}, static_layout(graph))
    for name, value in (("q_ptr", q_heads), ("k_ptr", k_heads), ("v_ptr", v_heads),
                        ("q_norm_ptr", q_norm.inputs[1] if norm else None),
                        ("k_norm_ptr", k_norm.inputs[1] if norm else None), ("pos_ptr", q_rope.inputs[1]),
                        ("slot_ptr", slots), ("q_out_ptr", q_rope.outputs[0]), ("k_cache_ptr", k_cache),
                        ("v_cache_ptr", v_cache), ("k_scale_ptr", k_scale), ("v_scale_ptr", v_scale)):
        p.tensor(name, value)
    for name, value in (("stride_q", q_heads), ("stride_k", k_heads), ("stride_v", v_heads),
                        ("stride_q_out", q_rope.outputs[0])):
        p.stride(name, value)
    constexprs = dict(HEADS=heads, KV_HEADS=kv_heads, HD=head_dim, EPS=q_norm.attrs["eps"] if norm else 1e-6,
                      NORM=norm, NORM_OFFSET=float(q_norm.attrs.get("offset", 0.0)) if norm else 0.0,
                      THETA=float(q_rope.attrs["theta"]), BLOCK_HALF=next_pow2(head_dim // 2),
                      ROT=q_rope.attrs.get("rotary_dim") or head_dim, BLOCK_HD=next_pow2(head_dim),
                      EARLY=uploaded(graph, q_rope.inputs[1]) and uploaded(graph, slots)
                      and (not norm or {q_norm.inputs[1], k_norm.inputs[1]} <= set(graph.params)),
                      **_rope_scaling_constexprs(q_rope.attrs.get("scaling")))
    row_symbol = types[q_heads].shape[0]
    rope = launch("rope.py", "qk_rope_kv_write_kernel", p, constexprs,
                  (GridDim((row_symbol,)), GridDim((heads + kv_heads,))), num_warps=1)
    if constexprs["ROT"] < head_dim:
        return kernel_spec(graph, node, row_symbol, [VariantSpec("head_rows", None, [rope])])
    rows_constexprs = {k: v for k, v in constexprs.items() if k not in ("EARLY", "ROT", "BLOCK_HD")} | {
        "BLOCK_HEADS": next_pow2(heads + kv_heads)}
    token_rows = launch("rope.py", "qk_rope_kv_write_rows_kernel", p, rows_constexprs, (GridDim((row_symbol,)),),
                        num_warps=4)
    # small decode steps keep a program per head (more programs, and programmatic launch); larger steps' tokens
    # take a program each, their tiny per-head programs costing more to run than their bytes
    return kernel_spec(graph, node, row_symbol, [VariantSpec("head_rows", ROPE_HEAD_ROWS, [rope]),
                                                 VariantSpec("token_rows", None, [token_rows])])


def _rope_scaling_constexprs(scaling: tuple | None) -> dict:
    """The rope op's scaling attribute as the kernel's SCALING code (0 none, 1 linear, 2 by_wavelength) and its
    numbers."""
    kind = {None: 0, "linear": 1, "by_wavelength": 2}[scaling[0] if scaling else None]
    numbers = [float(v) for v in (scaling or ())[1:]] + [1.0] * 4
    return dict(SCALING=kind, FACTOR=numbers[0], LOW_FREQ=numbers[1], HIGH_FREQ=numbers[2], ORIGINAL=numbers[3])
