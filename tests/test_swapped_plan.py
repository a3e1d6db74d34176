"""The decode GEMMs of 17 to 256 rows on sm_90 (backends/tilelang/swapped_plan.py): the Qwen3-4B plan offers each
GEMM the 32-, 64-, 128- and 256-row slots with its class's candidates in order (the first the default the SM
picks), K split only where the column tiles leave SMs idle, the splits' slices left as planes of MAX_ROWS rows
(scratch sized for the largest split) that the next norm launch adds, their sum deferred, every stage ring within
the shared memory of the CTAs the tile asks an SM to hold; and the runtime's buckets and defaults reach 256
sequences. Planning needs no compiler."""

import pytest

from pegainfer.backends.planning import PlanOptions, gemm_roles
from pegainfer.backends.select import choose
from pegainfer.backends.tilelang import plan as tilelang_plan
from pegainfer.backends.tilelang.launches import SM90_SHARED
from pegainfer.backends.spec import ParamKind, planes_of
from pegainfer.backends.tilelang.swapped_plan import MAX_ROWS, PREFILL, SLOT_PLAN, gemm_class, split_for, stages
from pegainfer.backends.triton.plan import NORMED_ALL, plan_kernel
from pegainfer.frontends.load import embedded_configs, load_spec
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.kernel import fused_ops
from pegainfer.passes.pipeline import lower
from pegainfer.runtime.gpu.engine import EngineOptions, bucket_for, decode_buckets
from pegainfer.runtime.scheduler import SchedulerConfig

SLOTS = (32, 64, 128, MAX_ROWS)


@pytest.fixture(scope="module")
def gemms():
    graph, _ = lower(load_spec(embedded_configs()["qwen3-4b"]).graph)
    return [(g, n) for g in graph.all_graphs() for n in g.nodes if n.op == KERNEL and "linear" in fused_ops(n)
            and "top_k" not in fused_ops(n)]


def slot_variants(graph, node, slot: int) -> list:
    """The slot's swapped and prefill tiles (the 16x64 tiles of the 16-row slot also serve 64 rows)."""
    return [v for v in tilelang_plan.candidates(graph, node, PlanOptions(block_size=16)) if v.max_rows == slot
            and v.name.startswith("wgmma_")]


def test_each_class_gets_its_planned_candidates_in_order(gemms):
    classes = set()
    for graph, node in gemms:
        roles = gemm_roles(node)
        kind = gemm_class(roles["n"], roles["act"])
        classes.add(kind)
        candidates = tilelang_plan.candidates(graph, node, PlanOptions(block_size=16))
        prefill = next(v for v in candidates if v.max_rows is None and 90 in v.sms)
        for slot in SLOTS:
            rows = min(slot, 128)  # the 256-row slot runs two blocks of the 128-row tile
            expected = [prefill.name if entry == PREFILL else f"{entry.form}_{rows}x{entry.columns}"
                        for entry in SLOT_PLAN[kind][slot]]
            assert [v.name for v in slot_variants(graph, node, slot)] == expected, (node.name, slot)
            for v in slot_variants(graph, node, slot):
                assert v.sms == (90,) and (v.name != prefill.name or v.launches[-1] == prefill.launches[-1]), v.name
    assert classes == {"wide", "narrow", "silu"}, "QKV, o_proj and down, gate/up"


def test_the_sm90_default_of_each_slot_is_the_first_candidate(gemms):
    for graph, node in gemms:
        kernel = plan_kernel(graph, node, PlanOptions(block_size=16))
        kernel.variants += tilelang_plan.candidates(graph, node, PlanOptions(block_size=16))
        _, selections = choose(kernel, kernel.variants, 90, {})
        chosen = {s.slot: s.chosen for s in selections}
        for slot in SLOTS:
            assert chosen[f"rows<={slot}"] == "tilelang:" + slot_variants(graph, node, slot)[0].name, (node.name, slot)


def test_split_tiles_fill_the_sms_and_sum_their_slices_in_scratch_sized_for_the_largest_split(gemms):
    split_seen = False
    for graph, node in gemms:
        roles = gemm_roles(node)
        n, k, act = roles["n"], graph.value_types()[roles["weight"]].shape[1], roles["act"]
        variants = tilelang_plan.candidates(graph, node, PlanOptions(block_size=16))
        splits = []
        for v in (v for v in variants if v.name.startswith("wgmma_swapped")):
            gemm = next(launch for launch in v.launches if launch.function == "swapped")
            c = gemm.constexprs
            split = c["SPLIT"]
            assert k % (c["BLOCK_K"] * split) == 0, (v.name, c)
            assert c["MIN_BLOCKS"] * c["STAGES"] * ((2 if act else 1) * c["BLOCK_N"] + c["BLOCK_M"]) \
                * c["BLOCK_K"] * 2 <= SM90_SHARED, (v.name, c)
            if split > 1:
                split_seen = True
                splits.append(split)
                total = v.launches[-1]
                assert not act and total.function == "sum_slices" and total.deferred, v.name
                assert (gemm.params[2].kind, gemm.params[2].value) == (ParamKind.PLANES, roles["out"])
                assert c["PARTIAL"] and c["PLANE_STRIDE"] == MAX_ROWS
                assert total.constexprs == dict(N=n, SPLIT=split, THREADS=128, PLANE_STRIDE=MAX_ROWS)
                # halving the split would leave fewer CTAs than SMs to fill
                ctas = n // c["BLOCK_N"] * -(-v.max_rows // c["BLOCK_M"])
                assert ctas * split // 2 < 132, (v.name, ctas, split)
            else:
                assert v.launches[-1] is gemm
        scratch = tilelang_plan.gemm_scratch(graph, node, variants)
        if splits:  # the 16-row planes tile's 4 x 16 rows fit in them
            assert scratch[planes_of(roles["out"])] == ("f32", (max(splits) * MAX_ROWS, n))
        else:
            assert planes_of(roles["out"]) not in scratch
    assert split_seen, "o_proj and down split K"


def test_the_swapped_slots_norm_launch_adds_planes_of_their_stride(gemms):
    """QKV's and gate/up's norm launch in the 17-256-row slots (swapped tiles, and the prefill tile where a slot
    takes it) adds the split o_proj's and down's planes of MAX_ROWS rows; in the 16-row slot's tiles, decode_planes'
    planes of 16 (the runtime sums planes of another stride); the prefill tile's own slot reads X2 as stored."""
    swapped = sixteen = 0
    for graph, node in gemms:
        for v in tilelang_plan.candidates(graph, node, PlanOptions(block_size=16)):
            norm = next((l for l in v.launches if l.function == "add_rms_norm" and l.constexprs.get("PLANES")), None)
            if norm is None:
                continue
            stride = norm.constexprs.get("PLANE_STRIDE")
            if v.name.startswith("wgmma_") and (v.max_rows or 0) > 16:  # the prefill tile in these slots too
                swapped += 1
                assert stride == MAX_ROWS, (node.name, v.name)
            elif v.max_rows == 16:
                sixteen += 1
                assert stride is None, (node.name, v.name)
    assert swapped and sixteen, "the normed GEMMs with an add read planes in both"
    for graph, node in gemms:
        for v in tilelang_plan.candidates(graph, node, PlanOptions(block_size=16)):
            if v.max_rows is None:
                assert not any(l.constexprs.get("PLANES") for l in v.launches), (node.name, v.name)


def test_split_count_stops_at_whole_k_steps_and_at_four():
    from pegainfer.backends.tilelang.swapped_plan import PAIR
    assert split_for(2560, 4096, PAIR, 32, 32, 128) == 4
    assert split_for(2560, 128 * 6, PAIR, 32, 32, 128) == 2  # a third split would cut a K step
    assert split_for(9728, 2560, PAIR, 64, 64, 128) == 1  # 152 column tiles fill the SMs
    assert stages(PAIR, 64, 128, 0) * (64 + 64) * 128 * 2 <= SM90_SHARED // 2


def test_the_lm_head_runs_its_64_row_tiles_after_a_norm_launch():
    graph, _ = lower(load_spec(embedded_configs()["qwen3-4b"]).graph)
    (body, node), = [(g, n) for g in graph.all_graphs() for n in g.nodes if n.op == KERNEL
                     and "top_k" in fused_ops(n)]
    spec = plan_kernel(body, node, PlanOptions(block_size=16))
    by_slot = {}
    for v in spec.variants:
        by_slot.setdefault(v.max_rows, []).append(v)
    for slot in (64, None):
        head = by_slot[slot][0]
        assert head.name == "dot_64", (slot, [v.name for v in by_slot[slot]])
        norm, gemm = head.launches[:2]
        assert norm.function == "add_rms_norm_kernel" and gemm.function == "linear_kernel"
        assert not gemm.constexprs["NORM"] and not gemm.constexprs["GATHER"]
        assert [p.value for p in gemm.params if p.name == "x_ptr"] == [NORMED_ALL]
    assert NORMED_ALL in spec.scratch


def test_buckets_and_defaults_reach_256_sequences():
    assert EngineOptions().max_batch == 256 and SchedulerConfig().max_num_seqs == 256
    buckets = decode_buckets(256)
    assert buckets[-1] == 256 and bucket_for(129, buckets) == 136 and bucket_for(255, buckets) == 256
