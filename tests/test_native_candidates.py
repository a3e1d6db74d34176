"""The TileLang and CuTe DSL candidates exist only for kernels their templates implement in full: attention over a
sliding window or a GELU GEMM must stay with Triton, whose templates take those settings, or the sm_90 default
(TileLang for prefill) would compute something else; a GEMM whose RMSNorm scales by 1 + weight (Gemma's, Qwen3.5's)
is native, each launch that reads the norm's weight told the offset. Planning needs no compiler, so this runs
wherever the tests run."""

import json
import re
from pathlib import Path

import pytest

from pegainfer.backends.cute import plan as cute_plan
from pegainfer.backends.tilelang import plan as tilelang_plan
from pegainfer.backends.planning import PlanOptions, gemm_roles
from pegainfer.backends.spec import ParamKind
from pegainfer.frontends.load import load_spec
from pegainfer.ir.graph import KERNEL
from pegainfer.ir.kernel import fused_ops
from pegainfer.passes.pipeline import lower

CONFIGS = Path(__file__).resolve().parent.parent / "models" / "configs"


def kernels(config: Path):
    graph, _ = lower(load_spec(config).graph)
    return [(g, n) for g in graph.all_graphs() for n in g.nodes if n.op == KERNEL]


def offers(plan, graph, node) -> bool:
    return bool(plan.candidates(graph, node, PlanOptions(block_size=16)))


def reads_norm_weight(launch) -> bool:
    """Whether the launch reads the norm's weight G: TileLang's by a parameter of that name, CuTe's GEMV (whose
    parameters are fixed) where it norms."""
    return any(p.name == "G" for p in launch.params) or bool(launch.constexprs.get("NORM"))


# config, overrides (Gemma 3 1B at a width both backends' tiles take), the offset of its norms before a GEMM
NORMED_CONFIGS = {"gemma-3-1b": ({"hidden_size": 1024}, 1.0), "qwen3.5-0.8b": ({}, 1.0), "qwen3-4b": ({}, 0.0)}


@pytest.mark.parametrize("plan", [tilelang_plan, cute_plan], ids=["tilelang", "cute"])
@pytest.mark.parametrize("name", sorted(NORMED_CONFIGS))
def test_native_gemms_with_a_norm_pass_its_offset_to_every_launch_that_reads_its_weight(plan, name, tmp_path):
    """A GEMM whose norm scales by 1 + weight (Gemma 3's, Qwen3.5's) gets native candidates, and every launch of
    them that reads G (the norm launch, decode_normed.py's tile, CuTe's GEMV) carries NORM_OFFSET=1.0; Qwen3's
    carry 0.0. Gemma's GELU x up still gets none, and the GEMMs without a norm are still offered."""
    overrides, offset = NORMED_CONFIGS[name]
    config = json.loads((CONFIGS / f"{name}.json").read_text()) | overrides
    (tmp_path / "config.json").write_text(json.dumps(config))
    gemms = [(g, n) for g, n in kernels(tmp_path / "config.json")
             if "linear" in fused_ops(n) and "top_k" not in fused_ops(n)]
    normed = [(g, n, gemm_roles(n)) for g, n in gemms if gemm_roles(n)["norm"]]
    assert normed and all(roles["norm_offset"] == offset for _, _, roles in normed), name
    offered = 0
    for graph, node, roles in normed:
        variants = plan.candidates(graph, node, PlanOptions(block_size=16))
        assert not variants or roles["act"] in (0, 1), (node.name, "GELU x up stays with Triton")
        readers = [launch for v in variants for launch in v.launches if reads_norm_weight(launch)]
        assert bool(readers) == bool(variants), node.name
        assert all(launch.constexprs["NORM_OFFSET"] == offset for launch in readers), node.name
        offered += bool(variants)
    assert offered, f"{name}: some GEMM with a norm gets {plan.__name__}'s candidates"
    plain = [(g, n) for g, n in gemms if not gemm_roles(n)["norm"] and not gemm_roles(n)["act"]]
    assert any(offers(plan, g, n) for g, n in plain), "the GEMMs without a norm are still offered"


def as_input(graph, name: str):
    """A copy of the graph where parameter `name` is a graph input instead (a value some kernel could write)."""
    import copy
    moved = copy.deepcopy(graph)
    moved.inputs[name] = moved.params.pop(name)
    return moved


@pytest.mark.parametrize("plan", [tilelang_plan, cute_plan], ids=["tilelang", "cute"])
@pytest.mark.parametrize("role", ["weight", "norm"])
def test_no_native_gemm_whose_weights_are_not_parameters(plan, role):
    """The decode tiles read their weights (and the norm's) before waiting for the previous kernel: only a
    parameter is sure not to be that kernel's output."""
    (graph, node), *_ = [(g, n) for g, n in kernels(CONFIGS / "qwen3-4b.json")
                         if "linear" in fused_ops(n) and gemm_roles(n)["norm"] and "top_k" not in fused_ops(n)]
    assert offers(plan, graph, node)
    assert not offers(plan, as_input(graph, gemm_roles(node)[role]), node)


def test_rope_reads_before_its_wait_only_step_inputs_and_parameters():
    """q/k norm + RoPE + KV write reads the position, the slot and the norms' weights before waiting (EARLY) only
    when those are step inputs and parameters."""
    from pegainfer.backends.triton.plan import plan_kernel
    ((graph, node),) = [(g, n) for g, n in kernels(CONFIGS / "qwen3-4b.json") if "rope" in fused_ops(n)]
    def early(g) -> bool:
        return plan_kernel(g, node, PlanOptions(block_size=16)).variants[0].launches[0].constexprs["EARLY"]
    norm_weight = next(n for n in node.attrs["nodes"] if n.op == "rms_norm").inputs[1]
    assert early(graph) is True and early(as_input(graph, norm_weight)) is False


def test_no_tilelang_attention_over_a_sliding_window():
    attention = [(g, n) for g, n in kernels(CONFIGS / "mistral-7b-v0.1.json") if fused_ops(n) == ["paged_attention"]]
    assert attention and all(n.attrs["nodes"][0].attrs.get("window", 0) > 0 for _, n in attention)
    assert not any(offers(tilelang_plan, g, n) for g, n in attention)
    full = [(g, n) for g, n in kernels(CONFIGS / "qwen3-4b.json") if fused_ops(n) == ["paged_attention"]]
    assert all(offers(tilelang_plan, g, n) for g, n in full)


def test_prefill_defaults_merged_gate_up_and_a_tile_per_width():
    """The sm_90 prefill defaults (each kernel's first tile): the merged tile (gate and up in one accumulator) for
    SiLU x up and nothing else; 128x192 where N allows (QKV, N = 6144) and 128x160 for N = 2560 (o_proj, down)."""
    gemms = [(g, n) for g, n in kernels(CONFIGS / "qwen3-4b.json") if "linear" in fused_ops(n)]
    names = {n.name: [v.name for v in tilelang_plan.candidates(g, n, PlanOptions(block_size=16)) if v.max_rows is None]
             for g, n in gemms}
    act = {n.name for _, n in gemms if gemm_roles(n)["act"]}
    assert act, "Qwen3's MLP has a SiLU x up kernel"
    for node in act:
        assert names[node][:2] == ["wgmma_merged_128x256", "wgmma_fullrow_128x128"], names[node]
    assert not any("wgmma_merged_128x256" in names[node] for node in names.keys() - act)
    assert names["qkv"][0] == "wgmma_fullrow_128x192", names["qkv"]
    assert names["o_proj"][0] == names["down"][0] == "wgmma_fullrow_128x160", (names["o_proj"], names["down"])


def test_decode_tiles_serve_four_and_sixteen_rows_with_the_chained_tile_first():
    """TileLang's decode GEMMs: slots of 4 and 16 rows (one row: the normed and halved tiles, below) and the 16x64 tile
    at 17-64 rows,
    sm_90 only, decode_tile.py's 16x16 tile first, launched programmatically, a single GEMM's stages in chains (the
    narrow o_proj and down deeper, at 2 CTAs an SM; the wide QKV's rows first after its wait: PRE), then for tuning
    gemm.py's mma_16x32 and mma_16x64 (single GEMMs) or decode_tile.py's decode_tile_16x64 (SiLU x up); every stage
    ring fits the shared memory of the CTAs the tile asks an SM to hold."""
    from pegainfer.backends.tilelang.plan import NARROW_CHAINED, NARROW_N, SILU_16X16, SM90_SHARED, WIDE_CHAINED

    gemms = [(g, n) for g, n in kernels(CONFIGS / "qwen3-4b.json") if "linear" in fused_ops(n)]
    offered = 0
    for graph, node in gemms:
        decode = [v for v in tilelang_plan.candidates(graph, node, PlanOptions(block_size=16))
                  if v.max_rows is not None and not v.name.startswith("wgmma_")  # 17-256 rows: test_swapped_plan.py
                  and v.name not in ("decode_normed_4x16", "decode_halved_4x8", "decode_planes_16x32")]
        if not decode:
            continue
        offered += 1
        n, act = gemm_roles(node)["n"], gemm_roles(node)["act"]
        for rows in (4, 16):
            names = [v.name for v in decode if v.max_rows == rows]
            assert names == ["decode_tile_16x16", *(["decode_tile_16x64"] if act else ["mma_16x32", "mma_16x64"])], \
                (node.name, names)
        assert {v.max_rows for v in decode} == {4, 16, 64} and all(v.sms == (90,) for v in decode)
        # steps of 17-64 rows: the 16x64 tile alone, the same launches as at 16 rows
        mid = [v for v in decode if v.max_rows == 64]
        assert [v.name for v in mid] == ["decode_tile_16x64" if act else "mma_16x64"], (node.name, mid)
        assert mid[0].launches == next(v for v in decode if v.max_rows == 16 and v.name == mid[0].name).launches
        chained = SILU_16X16 if act else NARROW_CHAINED if n <= NARROW_N else WIDE_CHAINED
        for v in decode:
            launch = v.launches[-1]
            tiles = launch.constexprs
            sixteen = v.name == "decode_tile_16x16"
            # the 16x16 tile and SiLU x up through the hand-specialised template, else gemm.py's warp-specialised one
            assert launch.function == ("decode_tile" if sixteen or act else "gemm"), (v.name, launch.function)
            assert tiles.get("PDL", False) == sixteen, (v.name, tiles)
            if sixteen:
                assert (tiles["CHAINS"], tiles["PRE"], tiles["MIN_BLOCKS"]) == (
                    chained.chains, chained.pre, chained.min_blocks), (v.name, tiles)
            assert tiles.get("CHAINS", 1) == 1 or not act, "SiLU x up has two GEMMs a stage already"
            assert tiles.get("PRE", 0) <= tiles["STAGES"]
            assert sixteen or act or (tiles["ASYNC_ROWS"] and tiles["BLOCK_M"] == 16), tiles
            stage = (16 + tiles["BLOCK_N"] * (2 if act else 1)) * tiles["BLOCK_K"] * 2
            assert tiles["STAGES"] >= 2 and tiles["MIN_BLOCKS"] * (tiles["STAGES"] * stage + 2048) <= SM90_SHARED, \
                tiles
            norm = v.launches[:-1]
            assert [launch.function for launch in norm] == (["add_rms_norm"] if gemm_roles(node)["norm"] else [])
            assert all(launch.constexprs["PDL"] for launch in norm), "the norm launch lets its GEMM start at once"
    assert offered == 4, "QKV, o_proj, gate/up and down each get decode tiles"


def test_split_tile_serves_sixteen_rows_where_the_next_norm_launch_adds_its_planes():
    """o_proj and down (read only as the X2 of the next norm launch's add: down's through the next layer's input)
    get decode_planes.py's tile first at 16 rows: 32 weight rows a CTA over a quarter of K, its fp32 planes
    ([64, N]) in a scratch of the kernel, then the sum of those planes into C, deferred; the norm launches of QKV and
    gate/up name X2's planes and their rows; QKV and gate/up, whose outputs go elsewhere, get no split tile."""
    from pegainfer.backends.tilelang.plan import MAX_PLANES, PLANES_SPLIT, SM90_SHARED

    planned = {}
    for graph, node in kernels(CONFIGS / "qwen3-4b.json"):
        if "linear" not in fused_ops(node) or "top_k" in fused_ops(node):
            continue
        variants = tilelang_plan.candidates(graph, node, PlanOptions(block_size=16))
        planned[node.name] = (graph, node, variants)
    for name in ("qkv", "gate_up"):
        graph, node, variants = planned[name]
        assert "decode_planes_16x32" not in [v.name for v in variants], name
        x2 = gemm_roles(node)["x2"]
        for v in variants:
            if v.name != "decode_tile_16x16":
                continue
            norm = v.launches[0]
            assert norm.function == "add_rms_norm" and norm.constexprs["PLANES"] == MAX_PLANES >= PLANES_SPLIT
            assert [(p.name, p.kind, p.value) for p in norm.params[-2:]] == [
                ("P", ParamKind.PLANES, x2), ("PR", ParamKind.PLANE_ROWS, x2)]
    for name, k in (("o_proj", 4096), ("down", 9728)):
        graph, node, variants = planned[name]
        sixteen = [v.name for v in variants if v.max_rows == 16]
        assert sixteen[0] == "decode_planes_16x32" and "decode_tile_16x16" in sixteen, sixteen
        (v,) = [v for v in variants if v.name == "decode_planes_16x32"]
        gemm, total = v.launches
        tiles = gemm.constexprs
        assert (gemm.module, gemm.function) == ("decode_planes.py", "decode_planes")
        assert (tiles["PARTIAL"], tiles["SPLIT"], tiles["BLOCK_N"], tiles["PDL"]) == (True, 4, 32, True)
        assert tiles["BLOCK_K"] == (256 if k == 4096 else 128) and k % (tiles["BLOCK_K"] * 4) == 0
        stage = (16 + tiles["BLOCK_N"]) * tiles["BLOCK_K"] * 2
        assert tiles["MIN_BLOCKS"] * (tiles["STAGES"] * stage + 2048) <= SM90_SHARED
        assert [p.buffer for p in gemm.params] == [gemm_roles(node)["x"], gemm_roles(node)["weight"],
                                                   f"planes:{name}", None]
        assert total.function == "sum_planes" and total.deferred and not gemm.deferred
        assert {(p.kind, p.value) for p in total.params} == {(ParamKind.PLANES, name), (ParamKind.TENSOR, name),
                                                             (ParamKind.DIM, "tokens")}
        # the scratch holds the swapped tiles' planes too: up to four of 256 rows (its 64 rows fit in them)
        assert tilelang_plan.gemm_scratch(graph, node, variants)[f"planes:{name}"] == ("f32", (1024, 2560))
        assert 2560 // tiles["BLOCK_N"] * tiles["SPLIT"] == 320


def test_no_split_tile_where_a_kernel_reads_the_output_itself(tmp_path):
    """Gemma 3 norms o_proj's output before its add (a plain norm launch reads it): the planes would be summed by a
    launch of their own, so o_proj keeps the 16x16 tile there (at the 4B model's width, where it would have 320)."""
    config = json.loads((CONFIGS / "gemma-3-1b.json").read_text()) | {"hidden_size": 2560}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for graph, node in kernels(tmp_path / "config.json"):
        if fused_ops(node) == ["linear"] and gemm_roles(node)["out"].startswith("o_proj"):
            names = [v.name for v in tilelang_plan.candidates(graph, node, PlanOptions(block_size=16))]
            assert "decode_planes_16x32" not in names and "decode_tile_16x16" in names, names
            break
    else:
        raise AssertionError(f"no o_proj kernel in {config['architectures']}")


def qwen3_gemm_candidates():
    """(node, roles, TileLang's candidates) of each GEMM kernel of Qwen3-4B."""
    for graph, node in kernels(CONFIGS / "qwen3-4b.json"):
        if "linear" in fused_ops(node):
            yield node, gemm_roles(node), tilelang_plan.candidates(graph, node, PlanOptions(block_size=16))


def test_gemms_with_a_norm_get_the_normed_tile_for_one_and_four_rows():
    """QKV and gate/up (an RMSNorm prologue) get decode_normed.py's tile for steps of one row and of up to 4,
    first in both slots (so the sm_90 default): no norm launch before it, the rows (and X2's) read as stored, the
    residual sum written by the tile, launched programmatically, 4 rows a CTA (the stage's other 4 hold X2's rows and
    then each product's low half), and a ring that lets 3 CTAs share an SM. o_proj and down (no norm) get none
    (the halved tile below serves their one-row slot)."""
    from pegainfer.backends.tilelang.plan import SM90_SHARED

    served = set()
    for node, roles, variants in qwen3_gemm_candidates():
        normed = [v for v in variants if v.name == "decode_normed_4x16"]
        if not roles["norm"] or roles["rows"]:
            assert normed == [] and {v.name for v in variants if v.max_rows == 1} <= {"decode_halved_4x8"}, \
                node.name
            continue
        assert [v.max_rows for v in normed] == [1, 4] and normed[0].launches == normed[1].launches
        assert [v for v in variants if v.max_rows == 4][0] is normed[1], "the 4-row slot's first (default) tile"
        assert [v for v in variants if v.max_rows == 1][0] is normed[0], "the 1-row slot's first (default) tile"
        (launch,) = normed[0].launches
        tiles = launch.constexprs
        assert normed[0].sms == (90,) and (launch.module, launch.function) == ("decode_normed.py", "decode_normed")
        assert tiles["PDL"] and tiles["ACT"] == roles["act"] and tiles["CHAINS"] == (1 if roles["act"] else 2)
        assert tiles["ADD"] == (roles["x2"] is not None) and tiles["WRITE_SUM"] == (roles["sum"] is not None)
        values = {p.name: p.value for p in launch.params}
        assert values["A"] == roles["x"] and values["G"] == roles["norm"] and values["C"] == roles["out"]
        assert values.get("X2") == roles["x2"] and values.get("S") == roles["sum"]
        assert launch.grid[1].block == 4
        # the rows scaled in a warpgroup of their own, after the consumer warp and the producer
        assert launch.num_warps == 9
        weights = 16 * tiles["BLOCK_K"] * 2 * (2 if tiles["ACT"] else 1)
        stage = weights + 8 * tiles["BLOCK_K"] * 2
        # G whole beside the stages, about 3 KB for the scalers' reduction, the barriers, 1/rms and the products'
        # exchange, and the system's 1 KB
        assert tiles["MIN_BLOCKS"] * (tiles["STAGES"] * stage + tiles["K"] * 2 + 4096) <= SM90_SHARED, tiles
        served.add(roles["act"])
    assert served == {0, 1}, "QKV and gate/up"


def test_single_gemms_get_the_halved_tile_for_one_and_four_rows():
    """The single GEMMs (QKV, o_proj, down) get decode_halved.py's tile for steps of one row and of up to 4:
    the default where no norm tile leads the slot (o_proj, down), behind it for QKV (after the norm launch); none for
    SiLU x up. 8 weight rows a CTA over both K halves (W read as [2N, K/2]), 4 rows a CTA, no split, four mma
    chains, launched programmatically, weight stages issued before the wait cut to SHORT_PRE for a short K range,
    and a ring that lets 3 CTAs share an SM."""
    from pegainfer.backends.tilelang.plan import SHORT_PRE, SHORT_STEPS, SM90_SHARED

    defaults = set()
    for node, roles, variants in qwen3_gemm_candidates():
        halved = [v for v in variants if v.name == "decode_halved_4x8"]
        if roles["act"] or roles["rows"]:
            assert halved == [], node.name
            continue
        assert [v.max_rows for v in halved] == [1, 4] and halved[0].launches == halved[1].launches
        *norm, launch = halved[0].launches
        assert [n.function for n in norm] == (["add_rms_norm"] if roles["norm"] else [])
        tiles = launch.constexprs
        assert (launch.module, launch.function) == ("decode_halved.py", "decode_halved") and halved[0].sms == (90,)
        assert (tiles["BLOCK_N"], tiles["CHAINS"], tiles["PDL"]) == (16, 4, True) and len(launch.grid) == 3
        assert launch.grid[0].block == 8 and launch.grid[1].block == 4 and launch.grid[2].size({}) == 1
        steps = tiles["K"] // 2 // tiles["BLOCK_K"]
        assert tiles["K"] % (2 * tiles["BLOCK_K"]) == 0
        assert tiles.get("PRE", 0) == (SHORT_PRE if steps <= SHORT_STEPS else 0), (node.name, steps, tiles)
        stage = (16 + 8) * tiles["BLOCK_K"] * 2
        assert tiles["MIN_BLOCKS"] == 3 and 3 * (tiles["STAGES"] * stage + 2048) <= SM90_SHARED, tiles
        first = {rows: [v for v in variants if v.max_rows == rows][0] for rows in (1, 4)}
        if first[1] is halved[0] and first[4] is halved[1]:
            defaults.add(node.name)
    assert defaults == {"o_proj", "down"}


def test_halved_tile_needs_two_ctas_an_sm():
    """The halved tile is offered only where N makes HALVED_MIN_CTAS CTAs of 8 columns: Qwen3-30B-A3B's router (128
    columns, 16 CTAs) and Gemma 3 1B's o_proj (1152 columns, 144) get none, so their one-row slot stays Triton's;
    Llama 3.1 8B's o_proj and down (4096 columns) get it."""
    from pegainfer.backends.tilelang.plan import HALVED_MIN_CTAS

    def halved(config: str) -> dict[str, bool]:
        offered = {}
        for graph, node in kernels(CONFIGS / config):
            roles = gemm_roles(node) if "linear" in fused_ops(node) else None
            if roles and not roles["act"] and not roles["rows"]:
                names = {v.name for v in tilelang_plan.candidates(graph, node, PlanOptions(block_size=16))}
                offered[node.name] = ("decode_halved_4x8" in names, roles["n"] // 8 >= HALVED_MIN_CTAS)
        return offered

    for config in ("qwen3-30b-a3b.json", "gemma-3-1b.json", "llama-3.1-8b.json"):
        for node, (offered, wide) in halved(config).items():
            assert offered == wide, (config, node)
    assert not halved("gemma-3-1b.json")["o_proj"][0] and halved("llama-3.1-8b.json")["down"][0]
    assert any(not wide for wide in [w for _, w in halved("qwen3-30b-a3b.json").values()])


TILE = dict(N=6144, K=2560, BLOCK_N=16, BLOCK_K=256, STAGES=5, THREADS=32, MIN_BLOCKS=3)
NORMED = dict(TILE, ACT=0, ADD=True, WRITE_SUM=True, EPS=1e-6)


@pytest.mark.parametrize("form, tile, says", [
    ("decode_tile", dict(TILE, ACT=0, CHAINS=3), "CHAINS splits a single GEMM's stages in 1, 2 or 4 (SiLU x up has "
                                                 "two GEMMs already), got 3"),
    ("decode_tile", dict(TILE, ACT=1, CHAINS=2), "got 2 with ACT=1"),
    ("decode_tile", dict(TILE, ACT=0, PRE=6), "PRE: weight stages issued before the rows, at most 5, got 6"),
    ("decode_tile", dict(TILE, ACT=0, K=2560 + 128), "K=2688 must be whole 256-wide steps"),
    ("decode_normed", dict(NORMED, ADD=False), "WRITE_SUM writes the sum of ADD's rows"),
    ("decode_normed", dict(NORMED, CHAINS=4, ACT=1), "got 4 with ACT=1"),
    ("decode_halved", dict(TILE, K=256 * 3), "K=768 must split into two halves of whole 256-wide steps"),
    ("decode_halved", dict(TILE, BLOCK_N=15), "BLOCK_N=15: whole weight rows over both K halves"),
    ("decode_planes", dict(TILE, SPLIT=1), "K=2560 must split into 1 > 1 ranges"),
    ("decode_planes", dict(TILE, SPLIT=4), "K=2560 must split into 4 > 1 ranges of whole 256-wide steps"),
    ("decode_planes", dict(TILE, SPLIT=2, PARTIAL=False), "decode_planes always leaves its sum to the kernel after"),
])
def test_decode_forms_refuse_a_tile_they_cannot_run(form, tile, says):
    """Each decode form refuses, before lowering, the settings its protocol does not cover (CHAINS', PRE's, K's
    steps, WRITE_SUM without its add, the halves' and the split's whole steps), saying which."""
    import importlib
    pytest.importorskip("tilelang")

    build = getattr(importlib.import_module(f"pegainfer.backends.tilelang.kernels.{form}"), form)
    with pytest.raises(AssertionError, match=re.escape(says)):
        build(**tile)
