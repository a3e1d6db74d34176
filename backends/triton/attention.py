"""Planning paged attention, named <form>_<query rows of a program>: flash_16, the launch of any step (a program
per sequence, KV head and 16-row query tile), split_kv_16 and split_kv_prefetch_16 for decode at small batch (each
sequence's keys over SPLIT_KV programs, then a merge) and flash_64, prefill-shaped tiles."""

from pegainfer.backends.planning import PREFILL_QUERIES, PlanOptions, static_layout
from pegainfer.backends.spec import GridDim, KernelSpec, LaunchSpec, VariantSpec
from pegainfer.backends.triton.launches import Params, kernel_spec, launch, next_pow2
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.graph import Graph, Node
from pegainfer.ir.step import uploaded
from pegainfer.ir.types import TensorType

SPLIT_KV = 16  # key slices per sequence for attention at small batch
# An FP8 cache's decode splits each sequence's keys at any batch: its flash_16 programs widen e4m3 in registers and
# lose the bf16 cache's asynchronous copies, so more, shorter programs hide the loads (H200, b64 at 4k: 19.0 -> 14.7 ms)
FP8_SPLIT_KV_MAX_BATCH = 256
PREFILL_ROWS = 64  # query rows (queries x the heads sharing a KV head) in a prefill-shaped tile


def plan_attention(graph: Graph, node: Node, options: PlanOptions) -> KernelSpec:
    (attention,) = node.attrs["nodes"]
    types = graph.value_types()
    heads, head_dim = types[attention.inputs[0]].shape[1:]
    p, constexprs = _attention_params(graph, attention, options)
    batch, kv_heads = types[attention.inputs[4]].shape[0], constexprs["KV_HEADS"]
    grid = (GridDim((batch,)), GridDim((kv_heads,)), GridDim(("max_query_len",), constexprs["BLOCK_Q"]))
    default = launch("attention.py", "paged_attention_kernel", p, constexprs, grid, num_warps=4)
    layout = static_layout(graph)
    split_launches, scratch = _plan_split_attention(types, layout, attention, constexprs, heads, head_dim)
    split_batch = options.split_kv_max_batch
    if split_batch and types[attention.inputs[1]].dtype.name.startswith("f8"):
        split_batch = FP8_SPLIT_KV_MAX_BATCH
    variants = [VariantSpec("split_kv_16", split_batch, split_launches)] if split_batch else []
    # One sequence: a decode step's programs (KV heads x SPLIT_KV) fit one wave with PREFETCH's registers; a prompt
    # chunk under PREFILL_QUERIES queries of one sequence runs it too, in more waves (not measured)
    if variants and constexprs["EARLY"]:
        prefetching, _ = _plan_split_attention(types, layout, attention, constexprs | {"PREFETCH": True}, heads,
                                               head_dim)
        variants.insert(0, VariantSpec("split_kv_prefetch_16", 1, prefetching))
    spec = kernel_spec(graph, node, batch, [_prefill_attention(p, constexprs, batch, kv_heads,
                                                               constexprs["GROUP_P2"]), *variants,
                                            VariantSpec("flash_16", None, [default])])
    spec.scratch = {name: (t.dtype.name, t.shape) for name, t in scratch.items()}
    return spec


def decode_rows_launch(graph: Graph, node: Node, options: PlanOptions) -> LaunchSpec:
    """flash_16's launch over the step's first `decode_seqs` sequences only, one query each: the decode rows of a
    mixed step, whose prompt chunks another launch takes (TileLang's 128-query tiles, backends/tilelang/plan.py)."""
    (attention,) = node.attrs["nodes"]
    p, constexprs = _attention_params(graph, attention, options)
    grid = (GridDim(("decode_seqs",)), GridDim((constexprs["KV_HEADS"],)), GridDim())
    return launch("attention.py", "paged_attention_kernel", p, constexprs, grid, num_warps=4)


def _attention_params(graph: Graph, attention: Node, options: PlanOptions) -> tuple[Params, dict]:
    """The kernel's parameters and its decode constexprs (16-row tiles: a few queries times the heads sharing a
    KV head)."""
    q, k_cache, v_cache, tables, starts, q_lens, ctx_lens = attention.inputs[:7]
    types = graph.value_types()
    heads, head_dim = types[q].shape[1], types[q].shape[2]
    kv_heads = types[k_cache].shape[2]
    group = heads // kv_heads
    group_p2 = next_pow2(group)
    p = Params(types | {attention.outputs[0]: attention.output_types[0]}, static_layout(graph))
    for name, value in (("q_ptr", q), *_caches(attention), ("tables_ptr", tables), ("starts_ptr", starts),
                        ("q_lens_ptr", q_lens), ("ctx_lens_ptr", ctx_lens), ("out_ptr", attention.outputs[0])):
        p.tensor(name, value)
    for name, value in (("stride_q", q), ("stride_out", attention.outputs[0]), ("stride_tables", tables)):
        p.stride(name, value)
    # 64 keys a tile: a decode program's time is its chain of dependent gathers through the block table. EARLY:
    # the lengths and the table are step inputs, read before the wait for the previous kernel; with PREFETCH (the
    # one-sequence split variant) so are the first tile's keys and values of earlier steps
    constexprs = dict(SCALE=float(attention.attrs["scale"]), KV_HEADS=kv_heads, HD=head_dim, GROUP=group,
                      CACHE_BLOCK=options.block_size, BLOCK_D=max(16, next_pow2(head_dim)), GROUP_P2=group_p2,
                      BLOCK_Q=max(1, 16 // group_p2), BLOCK_KV=max(64, options.block_size), UPCAST_DOT=False,
                      WINDOW=int(attention.attrs.get("window", 0)),
                      EARLY=all(uploaded(graph, v) for v in (tables, starts, q_lens, ctx_lens)), PREFETCH=False)
    return p, constexprs


def _prefill_attention(p: Params, constexprs: dict, batch: str, kv_heads: int, group_p2: int) -> VariantSpec:
    """Steps holding a prompt chunk: tiles of PREFILL_ROWS query rows feed the tensor cores far better than
    decode's 16 (a few queries times the heads sharing a KV head), which keep more programs busy on few rows."""
    block_q = max(1, PREFILL_ROWS // group_p2)
    constexprs = {**constexprs, "BLOCK_Q": block_q}
    grid = (GridDim((batch,)), GridDim((kv_heads,)), GridDim(("max_query_len",), block_q))
    tiles = launch("attention.py", "paged_attention_kernel", p, constexprs, grid, num_warps=4, num_stages=2)
    return VariantSpec("flash_64", None, [tiles], min_sizes={"max_query_len": PREFILL_QUERIES})


def _plan_split_attention(types: dict, layout: dict, attention: Node, constexprs: dict, heads: int,
                          head_dim: int) -> tuple[list[LaunchSpec], dict[str, TensorType]]:
    """Few sequences (decode at small batch) leave most SMs idle with one program per KV head: split each
    sequence's keys over SPLIT_KV programs and merge their partial softmaxes."""
    q, k_cache, v_cache, tables, starts, q_lens, ctx_lens = attention.inputs[:7]
    tokens = types[q].shape[0]
    scratch = {"attention.part_out": TensorType(dtype_from_name("f32"), (tokens, heads * SPLIT_KV * head_dim)),
               "attention.part_lse": TensorType(dtype_from_name("f32"), (tokens, heads * SPLIT_KV))}
    types = types | scratch | {attention.outputs[0]: attention.output_types[0]}
    layout = layout | {name: (t.shape[1], 0) for name, t in scratch.items()}
    split = Params(types, layout)
    for name, value in (("q_ptr", q), *_caches(attention), ("tables_ptr", tables), ("starts_ptr", starts),
                        ("q_lens_ptr", q_lens), ("ctx_lens_ptr", ctx_lens), ("part_out_ptr", "attention.part_out"),
                        ("part_lse_ptr", "attention.part_lse")):
        split.tensor(name, value)
    split.stride("stride_q", q)
    split.stride("stride_tables", tables)
    split_constexprs = {**constexprs, "HEADS": heads, "SPLITS": SPLIT_KV}
    batch = types[starts].shape[0]
    kv_heads = constexprs["KV_HEADS"]
    grid = (GridDim((batch,)), GridDim((kv_heads,)), GridDim(("max_query_len",), constexprs["BLOCK_Q"], SPLIT_KV))
    merge = Params(types, layout)
    for name, value in (("part_out_ptr", "attention.part_out"), ("part_lse_ptr", "attention.part_lse"),
                        ("out_ptr", attention.outputs[0])):
        merge.tensor(name, value)
    merge.stride("stride_out", attention.outputs[0])
    merge_constexprs = dict(HEADS=heads, HD=head_dim, BLOCK_D=constexprs["BLOCK_D"], SPLITS=SPLIT_KV)
    return [launch("attention.py", "paged_attention_split_kernel", split, split_constexprs, grid, num_warps=4),
            launch("attention.py", "attention_merge_kernel", merge, merge_constexprs,
                   (GridDim((tokens,)), GridDim((heads,))), num_warps=4)], scratch


def _caches(attention: Node) -> list[tuple[str, str | None]]:
    """The kernels' cache parameters: the caches, and an FP8 cache's two scales (None for another cache)."""
    k_cache, v_cache, *scales = attention.inputs[1:3] + attention.inputs[7:]
    k_scale, v_scale = scales or (None, None)
    return [("k_cache_ptr", k_cache), ("v_cache_ptr", v_cache), ("k_scale_ptr", k_scale), ("v_scale_ptr", v_scale)]
