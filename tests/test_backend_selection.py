"""Backend selection without a GPU: which variant each slot gets per SM (defaults, tuning data, conditional slots
that fall through), the runtime's variant rule, the steps `pegainfer tune` times each slot with, and `pegainfer
tune` refusing to run without a GPU."""

import pytest

from pegainfer.backends.build import parse_backends
from pegainfer.backends.manifest import Kernel, Launch, Manifest, Selection, Variant, dump, load
from pegainfer.backends.report import selection_table
from pegainfer.backends.select import choose, margin
from pegainfer.backends.spec import GridDim, KernelSpec, LaunchSpec, Param, ParamKind, VariantSpec, pick_variant
from pegainfer.cli import main
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.types import TensorType


def variant(backend: str, name: str, max_rows, min_sizes=None) -> VariantSpec:
    launch = LaunchSpec(name, "k.py", "", [], {}, (GridDim(),) * 3, backend=backend)
    return VariantSpec(name, max_rows, [launch], backend, min_sizes or {})


def gemm_kernel() -> KernelSpec:
    variants = [variant("triton", "gemv_1", 1), variant("triton", "dot_16", 16), variant("triton", "dot_32", 64),
                variant("triton", "dot_64", None), variant("cute", "gemv_1", 1),
                variant("tilelang", "decode_tile_16x16", 16), variant("tilelang", "wgmma", None)]
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
        assert [v.label for v in chosen] == ["triton:gemv_1", "triton:dot_16", "triton:dot_32",
                                             "triton:dot_64"]
        assert [r.by for r in records] == ["default"] * 4
    chosen, _ = choose(kernel, kernel.variants, 90, {})
    assert [v.label for v in chosen] == ["triton:gemv_1", "tilelang:decode_tile_16x16", "triton:dot_32",
                                         "tilelang:wgmma"]
    without_tilelang = [v for v in kernel.variants if v.backend != "tilelang"]
    chosen, _ = choose(kernel, without_tilelang, 90, {})  # compiled with --backends triton
    assert chosen[-1].label == "triton:dot_64"


def test_defaults_per_sm(hopper_preference):
    kernel = gemm_kernel()
    chosen, records = choose(kernel, kernel.variants, 90, {})
    assert [v.label for v in chosen] == ["cute:gemv_1", "triton:dot_16", "triton:dot_32", "tilelang:wgmma"]
    assert [r.by for r in records] == ["default"] * 4
    chosen, _ = choose(kernel, kernel.variants, 80, {})
    assert [v.label for v in chosen] == ["triton:gemv_1", "triton:dot_16", "triton:dot_32",
                                         "triton:dot_64"]


def test_a_backends_first_variant_of_a_slot_is_its_default(hopper_preference):
    """Tuning tiles sit beside a backend's default tile in the same slot; untuned, the default one runs."""
    variants = [variant("triton", "dot_64", None), variant("tilelang", "wgmma_128x128", None),
                variant("tilelang", "wgmma_fullrow_128x256", None)]
    kernel = KernelSpec("body", "down", "linear", ["linear"], "tokens", variants)
    chosen, records = choose(kernel, variants, 90, {})
    assert [v.label for v in chosen] == ["tilelang:wgmma_128x128"]
    assert records[0].alternatives == tuple(v.label for v in variants)


def test_tuning_data_overrides_the_default_and_reports_the_margin():
    kernel = gemm_kernel()
    tuning = {"kernels": {"body/down": {"any rows": {"choice": "triton:dot_64",
                                                     "times_us": {"triton:dot_64": 50.0, "tilelang:wgmma": 80.0}}}}}
    chosen, records = choose(kernel, kernel.variants, 90, tuning)
    assert chosen[-1].label == "triton:dot_64"
    assert records[-1].by == "tuned" and margin(records[-1]) == "1.60x over tilelang:wgmma"
    assert margin(records[0]) == "untuned"


def test_a_conditional_slot_comes_first_and_can_fall_through(hopper_preference):
    variants = [variant("triton", "split_kv_16", 16), variant("triton", "flash_16", None),
                variant("tilelang", "flash", None, {"max_query_len": 64})]
    kernel = KernelSpec("body", "attention", "paged_attention", ["paged_attention"], "batch", variants)
    chosen, records = choose(kernel, variants, 90, {})
    assert [v.label for v in chosen] == ["tilelang:flash", "triton:split_kv_16", "triton:flash_16"]
    assert records[0].slot == "any rows, max_query_len>=64"
    launched = KernelSpec("body", "attention", "paged_attention", ["paged_attention"], "batch", chosen)
    assert pick_variant(launched, {"batch": 1, "max_query_len": 8192}).name == "flash"
    assert pick_variant(launched, {"batch": 1, "max_query_len": 1}).name == "split_kv_16"
    assert pick_variant(launched, {"batch": 40, "max_query_len": 1}).name == "flash_16"
    tuning = {"kernels": {"body/attention": {records[0].slot: {"choice": "fallthrough", "times_us": {}}}}}
    chosen, _ = choose(kernel, variants, 90, tuning)
    assert [v.label for v in chosen] == ["triton:split_kv_16", "triton:flash_16"]


def test_a_mixed_steps_slot_is_tried_before_a_prefill_steps(hopper_preference):
    """Two conditions before one: a step of decode rows beside a prompt chunk takes the mixed variant, a step of
    prompt chunks alone (no leading one-query sequence) the prefill one, whatever order the plan lists them in."""
    prefill = {"max_query_len": 64}
    variants = [variant("tilelang", "flash", None, prefill), variant("triton", "flash_16", None),
                variant("tilelang", "mixed", None, prefill | {"decode_seqs": 1})]
    kernel = KernelSpec("body", "attention", "paged_attention", ["paged_attention"], "batch", variants)
    chosen, _ = choose(kernel, variants, 90, {})
    assert [v.name for v in chosen] == ["mixed", "flash", "flash_16"]
    assert pick_variant(kernel, {"batch": 64, "max_query_len": 1024, "decode_seqs": 62}).name == "mixed"
    assert pick_variant(kernel, {"batch": 2, "max_query_len": 1024, "decode_seqs": 0}).name == "flash"
    assert pick_variant(kernel, {"batch": 64, "max_query_len": 1, "decode_seqs": 64}).name == "flash_16"


def test_parse_backends_needs_triton_and_known_names():
    assert parse_backends("triton,cute") == ["triton", "cute"]
    for bad in ("tilelang", "triton,cutlass"):
        with pytest.raises(PegainferError, match="--backends"):
            parse_backends(bad)


def compiled(backend: str, name: str, max_rows, buffer: str = "x") -> Variant:
    """A manifest candidate whose one launch reads `buffer`."""
    launch = Launch(name, "k.py", (Param("x_ptr", ParamKind.TENSOR, buffer, "*bf16"),), {}, (GridDim(),) * 3, 4, 2,
                    backend, False, f"{name}{max_rows}", f"{name}{max_rows}.cubin", "", name, 0, 128, False)
    return Variant(name, max_rows, (launch,), backend)


def manifest_of(sm: int, candidates: list[Variant], scratch: dict | None = None,
                selection: list[Selection] | None = None) -> Manifest:
    kernel = Kernel("body", "down", "linear", ("linear",), "tokens", [], candidates, selection or [], {},
                    scratch or {})
    return Manifest("Qwen3ForCausalLM", "m", "config.json", sm, {"triton": "3.6.0"}, 16, "p", "g", [kernel])


def test_selection_table_names_the_winner(tmp_path):
    manifest = tmp_path / "m.json"
    chosen = Selection("any rows", ("triton:dot_64", "tilelang:wgmma"), "tuned", "tilelang:wgmma",
                       {"triton:dot_64": 90.0, "tilelang:wgmma": 60.0})
    dump(manifest_of(90, [], selection=[chosen]), manifest)
    table = selection_table(manifest)
    assert "tilelang:wgmma" in table and "1.50x over triton:dot_64" in table and "tuned" in table


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
    assert slot_sizes("tokens", (4, ()), 16)[1]["tokens"] == 4
    assert slot_sizes("tokens", (None, ()), 16)[1]["tokens"] == 4096
    assert slot_sizes("batch", (16, ()), 16)[1]["batch"] == 16
    prefill = slot_sizes("batch", (None, (("max_query_len", 64),)), 16)[1]
    assert prefill["batch"] == 1 and prefill["max_query_len"] == 4096


def test_reselect_rewrites_a_manifest_from_its_candidates(tmp_path, hopper_preference):
    from pegainfer.backends.select import reselect

    candidates = [compiled("triton", "gemv_1", 1), compiled("triton", "dot_64", None),
                  compiled("cute", "gemv_1", 1), compiled("tilelang", "wgmma", None, buffer="gemm.normed")]
    normed = TensorType(dtype_from_name("bf16"), ("tokens", 8))
    path = tmp_path / "m.json"
    dump(manifest_of(90, candidates, {"gemm.normed": normed}), path)
    reselect(path, {})
    (kernel,) = load(path).kernels
    assert [v.label for v in kernel.variants] == ["cute:gemv_1", "tilelang:wgmma"]
    assert kernel.scratch == {"gemm.normed": normed}
    reselect(path, {"kernels": {"body/down": {"any rows": {"choice": "triton:dot_64", "times_us": {}}}}})
    (kernel,) = load(path).kernels
    assert [v.label for v in kernel.variants] == ["cute:gemv_1", "triton:dot_64"]
    assert kernel.scratch == {} and kernel.selection[1].by == "tuned"


def test_reselect_keeps_a_variant_that_serves_two_slots_under_one_label(tmp_path):
    """A TileLang decode tile is a candidate of the 4- and 16-row slots under one label: tuning either slot to it
    keeps it in that slot (a lookup by label alone kept only one of the two, and the other slot fell back)."""
    from pegainfer.backends.select import reselect, slot_candidates

    candidates = [compiled("triton", "gemv_4", 4), compiled("triton", "dot_16", 16),
                  compiled("triton", "many", None), compiled("tilelang", "decode_tile_16x16", 4),
                  compiled("tilelang", "decode_tile_16x16", 16)]
    path = tmp_path / "m.json"
    dump(manifest_of(80, candidates), path)
    tuned = {"choice": "tilelang:decode_tile_16x16", "times_us": {}}
    reselect(path, {"kernels": {"body/down": {"rows<=4": tuned, "rows<=16": tuned}}})
    (kernel,) = load(path).kernels
    assert [(v.label, v.max_rows) for v in kernel.variants] == [
        ("tilelang:decode_tile_16x16", 4), ("tilelang:decode_tile_16x16", 16), ("triton:many", None)]
    four = next(s for s in kernel.selection if s.slot == "rows<=4")
    assert [v.max_rows for v in slot_candidates(kernel, four)] == [4, 4]


def test_hopper_runs_a_gemm_whose_norm_scales_by_one_plus_weight_on_tilelang():
    """Qwen3.5's gate/up (its RMSNorm scales by 1 + weight) takes TileLang's tiles in every slot on sm_90 by
    default, each launch reading the norm's weight with NORM_OFFSET=1.0; on sm_80, whose default is Triton,
    Triton's."""
    from pegainfer.backends.build import _supported, plan_model
    from pegainfer.backends.planning import PlanOptions
    from pegainfer.frontends.load import embedded_configs, load_spec

    spec = load_spec(embedded_configs()["qwen3.5-0.8b"])
    (gate_up,) = [k for k in plan_model(spec, PlanOptions(), ("triton", "tilelang", "cute"))[1] if k.node == "gate_up"]
    chosen, _ = choose(gate_up, _supported(gate_up, 90), 90, {})
    assert chosen and all(v.backend == "tilelang" for v in chosen), [v.label for v in chosen]
    normed = [launch for v in chosen for launch in v.launches if any(p.name == "G" for p in launch.params)]
    assert normed and all(launch.constexprs["NORM_OFFSET"] == 1.0 for launch in normed)
    assert all(v.backend == "triton" for v in choose(gate_up, _supported(gate_up, 80), 80, {})[0])
