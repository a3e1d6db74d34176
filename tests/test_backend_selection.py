"""Backend selection without a GPU: which variant each slot gets per SM (defaults, tuning data, conditional slots
that fall through), the runtime's variant rule, the steps `pegainfer tune` times each slot with, and `pegainfer
tune` refusing to run without a GPU."""

import json

import pytest

from pegainfer.backends.build import parse_backends
from pegainfer.backends.report import selection_table
from pegainfer.backends.select import choose, margin
from pegainfer.backends.spec import GridDim, KernelSpec, LaunchSpec, VariantSpec, pick_variant
from pegainfer.cli import main
from pegainfer.errors import PegainferError


def variant(backend: str, name: str, max_rows, min_sizes=None) -> VariantSpec:
    launch = LaunchSpec(name, "k.py", "", [], {}, (GridDim(),) * 3, backend=backend)
    return VariantSpec(name, max_rows, [launch], backend, min_sizes or {})


def gemm_kernel() -> KernelSpec:
    variants = [variant("triton", "one_row", 1), variant("triton", "small_rows", 16), variant("triton", "mid_rows", 64),
                variant("triton", "many_rows", None), variant("cute", "gemv_1", 1),
                variant("tilelang", "decode_16x16", 16), variant("tilelang", "wgmma", None)]
    return KernelSpec("body", "down", "linear", ["linear"], "tokens", variants)


@pytest.fixture
def hopper_preference(monkeypatch):
    """A preference table for sm_90 like the one tuning results may justify (the shipped default is Triton)."""
    from pegainfer.backends import select

    monkeypatch.setitem(select.DEFAULT_PREFERENCE, 90, {"gemm": ("tilelang", "triton"), "gemv": ("cute", "triton"),
                                                        "attention": ("tilelang", "triton")})


def test_the_shipped_default_is_tilelang_for_hopper_prefill_and_small_decode_and_triton_elsewhere():
    kernel = gemm_kernel()
    for sm in (80, 120):
        chosen, records = choose(kernel, kernel.variants, sm, {})
        assert [v.label for v in chosen] == ["triton:one_row", "triton:small_rows", "triton:mid_rows",
                                             "triton:many_rows"]
        assert [r["by"] for r in records] == ["default"] * 4
    chosen, _ = choose(kernel, kernel.variants, 90, {})
    assert [v.label for v in chosen] == ["triton:one_row", "tilelang:decode_16x16", "triton:mid_rows",
                                         "tilelang:wgmma"]
    without_tilelang = [v for v in kernel.variants if v.backend != "tilelang"]
    chosen, _ = choose(kernel, without_tilelang, 90, {})  # compiled with --backends triton
    assert chosen[-1].label == "triton:many_rows"


def test_defaults_per_sm(hopper_preference):
    kernel = gemm_kernel()
    chosen, records = choose(kernel, kernel.variants, 90, {})
    assert [v.label for v in chosen] == ["cute:gemv_1", "triton:small_rows", "triton:mid_rows", "tilelang:wgmma"]
    assert [r["by"] for r in records] == ["default"] * 4
    chosen, _ = choose(kernel, kernel.variants, 80, {})
    assert [v.label for v in chosen] == ["triton:one_row", "triton:small_rows", "triton:mid_rows",
                                         "triton:many_rows"]


def test_a_backends_first_variant_of_a_slot_is_its_default(hopper_preference):
    """Tuning tiles sit beside a backend's default tile in the same slot; untuned, the default one runs."""
    variants = [variant("triton", "many_rows", None), variant("tilelang", "wgmma_128x128", None),
                variant("tilelang", "wgmma_128x256_rows", None)]
    kernel = KernelSpec("body", "down", "linear", ["linear"], "tokens", variants)
    chosen, records = choose(kernel, variants, 90, {})
    assert [v.label for v in chosen] == ["tilelang:wgmma_128x128"]
    assert records[0]["alternatives"] == [v.label for v in variants]


def test_tuning_data_overrides_the_default_and_reports_the_margin():
    kernel = gemm_kernel()
    tuning = {"kernels": {"body/down": {"any rows": {"choice": "triton:many_rows",
                                                     "times_us": {"triton:many_rows": 50.0, "tilelang:wgmma": 80.0}}}}}
    chosen, records = choose(kernel, kernel.variants, 90, tuning)
    assert chosen[-1].label == "triton:many_rows"
    assert records[-1]["by"] == "tuned" and margin(records[-1]) == "1.60x over tilelang:wgmma"
    assert margin(records[0]) == "untuned"


def test_a_conditional_slot_comes_first_and_can_fall_through(hopper_preference):
    variants = [variant("triton", "split_kv", 16), variant("triton", "default", None),
                variant("tilelang", "flash", None, {"max_query_len": 64})]
    kernel = KernelSpec("body", "attention", "paged_attention", ["paged_attention"], "batch", variants)
    chosen, records = choose(kernel, variants, 90, {})
    assert [v.label for v in chosen] == ["tilelang:flash", "triton:split_kv", "triton:default"]
    assert records[0]["slot"] == "any rows, max_query_len>=64"
    manifest = {"row_symbol": "batch", "node": "attention",
                "variants": [{"name": v.name, "max_rows": v.max_rows, "min_sizes": v.min_sizes} for v in chosen]}
    assert pick_variant(manifest, {"batch": 1, "max_query_len": 8192})["name"] == "flash"
    assert pick_variant(manifest, {"batch": 1, "max_query_len": 1})["name"] == "split_kv"
    assert pick_variant(manifest, {"batch": 40, "max_query_len": 1})["name"] == "default"
    tuning = {"kernels": {"body/attention": {records[0]["slot"]: {"choice": "fallthrough", "times_us": {}}}}}
    chosen, _ = choose(kernel, variants, 90, tuning)
    assert [v.label for v in chosen] == ["triton:split_kv", "triton:default"]


def test_parse_backends_needs_triton_and_known_names():
    assert parse_backends("triton,cute") == ["triton", "cute"]
    for bad in ("tilelang", "triton,cutlass"):
        with pytest.raises(PegainferError, match="--backends"):
            parse_backends(bad)


def test_selection_table_names_the_winner(tmp_path):
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps({"sm": 90, "backends": {"triton": "3.6.0"}, "kernels": [
        {"node": "down", "kind": "linear", "selection": [
            {"slot": "any rows", "alternatives": ["triton:many_rows", "tilelang:wgmma"], "chosen": "tilelang:wgmma",
             "by": "tuned", "times_us": {"triton:many_rows": 90.0, "tilelang:wgmma": 60.0}}]}]}))
    table = selection_table(manifest)
    assert "tilelang:wgmma" in table and "1.50x over triton:many_rows" in table and "tuned" in table


def test_tune_without_a_gpu_says_so(capsys):
    assert main(["tune", "qwen3-4b"]) == 1
    assert "pegainfer tune times kernels on a GPU and none is visible here" in capsys.readouterr().err


def test_synthetic_step_lands_in_the_slot_it_times():
    from pegainfer.runtime.gpu.kernel_bench import synthetic_step
    from pegainfer.runtime.gpu.tune import slot_sizes

    step, sizes = synthetic_step(3, 5, 40, 16)
    assert sizes["tokens"] == 15 and sizes["batch"] == 3 and sizes["max_query_len"] == 5
    assert list(step["context_lens"]) == [40, 40, 40] and list(step["seq_starts"]) == [0, 5, 10]
    assert list(step["positions"][:5]) == [35, 36, 37, 38, 39]
    blocks = step["block_tables"]
    assert blocks.shape == (3, 3) and len(set(blocks.ravel())) == 9 and blocks.max() < sizes["num_blocks"]
    gemm = {"row_symbol": "tokens"}
    assert slot_sizes(gemm, {"bound": 4, "min_sizes": {}}, 16)[1]["tokens"] == 4
    assert slot_sizes(gemm, {"bound": None, "min_sizes": {}}, 16)[1]["tokens"] == 4096
    attention = {"row_symbol": "batch"}
    assert slot_sizes(attention, {"bound": 16, "min_sizes": {}}, 16)[1]["batch"] == 16
    prefill = slot_sizes(attention, {"bound": None, "min_sizes": {"max_query_len": 64}}, 16)[1]
    assert prefill["batch"] == 1 and prefill["max_query_len"] == 4096


def test_reselect_rewrites_a_manifest_from_its_candidates(tmp_path, hopper_preference):
    from pegainfer.backends.select import reselect

    def record(backend, name, max_rows, scratch=None):
        params = [{"kind": "tensor", "value": scratch or "x"}]
        return {"name": name, "label": f"{backend}:{name}", "backend": backend, "max_rows": max_rows,
                "min_sizes": {}, "launches": [{"key": name, "params": params}]}
    candidates = [record("triton", "one_row", 1), record("triton", "many_rows", None),
                  record("cute", "gemv_1", 1), record("tilelang", "wgmma", None, scratch="gemm.normed")]
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"sm": 90, "kernels": [
        {"graph": "body", "node": "down", "kind": "linear", "ops": ["linear"], "row_symbol": "tokens",
         "variants": [], "candidates": candidates, "candidate_scratch": {"gemm.normed": ["bf16", ["tokens", 8]]},
         "scratch": {}}]}))
    reselect(path, {})
    kernel = json.loads(path.read_text())["kernels"][0]
    assert [v["label"] for v in kernel["variants"]] == ["cute:gemv_1", "tilelang:wgmma"]
    assert kernel["scratch"] == {"gemm.normed": ["bf16", ["tokens", 8]]}
    reselect(path, {"kernels": {"body/down": {"any rows": {"choice": "triton:many_rows", "times_us": {}}}}})
    kernel = json.loads(path.read_text())["kernels"][0]
    assert [v["label"] for v in kernel["variants"]] == ["cute:gemv_1", "triton:many_rows"]
    assert kernel["scratch"] == {} and kernel["selection"][1]["by"] == "tuned"


def test_reselect_keeps_a_variant_that_serves_two_slots_under_one_label(tmp_path):
    """A TileLang decode tile is a candidate of the 4- and 16-row slots under one label: tuning either slot to it
    keeps it in that slot (a lookup by label alone kept only one of the two, and the other slot fell back)."""
    from pegainfer.backends.select import reselect, slot_candidates

    def record(backend, name, max_rows):
        return {"name": name, "label": f"{backend}:{name}", "backend": backend, "max_rows": max_rows,
                "min_sizes": {}, "launches": [{"key": f"{name}{max_rows}", "params": []}]}
    candidates = [record("triton", "fma_rows", 4), record("triton", "small_rows", 16), record("triton", "many", None),
                  record("tilelang", "decode_16x16", 4), record("tilelang", "decode_16x16", 16)]
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"sm": 80, "kernels": [
        {"graph": "body", "node": "down", "kind": "linear", "ops": ["linear"], "row_symbol": "tokens",
         "variants": [], "candidates": candidates, "candidate_scratch": {}, "scratch": {}}]}))
    tuned = {"choice": "tilelang:decode_16x16", "times_us": {}}
    reselect(path, {"kernels": {"body/down": {"rows<=4": tuned, "rows<=16": tuned}}})
    kernel = json.loads(path.read_text())["kernels"][0]
    assert [(v["label"], v["max_rows"]) for v in kernel["variants"]] == [
        ("tilelang:decode_16x16", 4), ("tilelang:decode_16x16", 16), ("triton:many", None)]
    four = next(r for r in kernel["selection"] if r["slot"] == "rows<=4")
    assert [v["max_rows"] for v in slot_candidates(kernel, four)] == [4, 4]
