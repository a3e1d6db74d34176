"""Backend selection without a GPU: which variant each slot gets per SM (defaults, tuning data, conditional slots
that fall through), the runtime's variant rule, the argument packing of TileLang's TMA descriptors and CuTe DSL's
tensor structs, and `pegainfer tune` refusing to run without a GPU."""

import ctypes
import json

import pytest

from pegainfer.backends.build import parse_backends
from pegainfer.backends.report import selection_table
from pegainfer.backends.select import choose, margin
from pegainfer.backends.spec import GridDim, KernelSpec, LaunchSpec, Param, VariantSpec, pick_variant
from pegainfer.cli import main
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.runtime.gpu.abi import DeviceTensor
from pegainfer.runtime.gpu.launch import pack_launch, shape_of
from pegainfer.runtime.gpu.tma import TENSOR_MAP_BYTES, TiledDescriptor, resolve


def variant(backend: str, name: str, max_rows, min_sizes=None) -> VariantSpec:
    launch = LaunchSpec(name, "k.py", "", [], {}, (GridDim(),) * 3, backend=backend)
    return VariantSpec(name, max_rows, [launch], backend, min_sizes or {})


def gemm_kernel() -> KernelSpec:
    variants = [variant("triton", "one_row", 1), variant("triton", "mid_rows", 64),
                variant("triton", "many_rows", None), variant("cute", "gemv_1", 1),
                variant("tilelang", "wgmma", None)]
    return KernelSpec("body", "down", "linear", ["linear"], "tokens", variants)


def test_defaults_per_sm():
    kernel = gemm_kernel()
    chosen, records = choose(kernel, kernel.variants, 90, {})
    assert [v.label for v in chosen] == ["cute:gemv_1", "triton:mid_rows", "tilelang:wgmma"]
    assert [r["by"] for r in records] == ["default"] * 3
    chosen, _ = choose(kernel, kernel.variants, 80, {})
    assert [v.label for v in chosen] == ["triton:one_row", "triton:mid_rows", "triton:many_rows"]


def test_tuning_data_overrides_the_default_and_reports_the_margin():
    kernel = gemm_kernel()
    tuning = {"kernels": {"body/down": {"any rows": {"choice": "triton:many_rows",
                                                     "times_us": {"triton:many_rows": 50.0, "tilelang:wgmma": 80.0}}}}}
    chosen, records = choose(kernel, kernel.variants, 90, tuning)
    assert chosen[-1].label == "triton:many_rows"
    assert records[-1]["by"] == "tuned" and margin(records[-1]) == "1.60x over tilelang:wgmma"
    assert margin(records[0]) == "untuned"


def test_a_conditional_slot_comes_first_and_can_fall_through():
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


BF16 = dtype_from_name("bf16")
DESCRIPTOR = {"dtype": 9, "rank": 2, "dims": [2560, "tokens"], "strides": [2, 5120], "box": [64, 128],
              "element_strides": [1, 1], "interleave": 0, "swizzle": 3, "l2_promotion": 2, "oob_fill": 0}


def test_tma_descriptor_resolves_step_sizes_and_checks_alignment():
    resolved = resolve(DESCRIPTOR, 0x1000, {"tokens": 300})
    assert resolved.dims == (2560, 300) and resolved.strides == (5120,) and resolved.box == (64, 128)
    with pytest.raises(PegainferError, match="not 16-byte aligned"):
        resolve(DESCRIPTOR, 0x1008, {"tokens": 300})
    with pytest.raises(PegainferError, match="multiples of 16 bytes"):
        resolve({**DESCRIPTOR, "strides": [2, 5122]}, 0x1000, {"tokens": 300})
    with pytest.raises(PegainferError, match="not a size of this step"):
        resolve(DESCRIPTOR, 0x1000, {"batch": 3})


def test_pack_launch_lays_out_tma_pointer_and_int_arguments():
    seen: list[TiledDescriptor] = []

    def encode(d: TiledDescriptor) -> bytes:
        seen.append(d)
        return bytes(range(TENSOR_MAP_BYTES))
    params = [{"name": "A_desc", "kind": "tma", "value": "x", "tma": DESCRIPTOR},
              {"name": "R", "kind": "tensor", "value": "r"},
              {"name": "M", "kind": "int", "value": "dim:tokens"},
              {"name": "MAXB", "kind": "int", "value": "stride:tables"}]
    tensors = {"x": DeviceTensor.contiguous(0x10000, (300, 2560), BF16),
               "r": DeviceTensor.contiguous(0x20000, (300, 2560), BF16),
               "tables": DeviceTensor(0x30000, (2, 7), dtype_from_name("i32"), 64)}
    args = pack_launch(params, tensors, {"tokens": 300}, encode=encode)
    pointers = [args.pointers[i] for i in range(4)]
    assert pointers[0] % 64 == 0 and ctypes.string_at(pointers[0], TENSOR_MAP_BYTES) == bytes(range(128))
    assert seen[0].address == 0x10000 and seen[0].dims == (2560, 300)
    assert ctypes.c_uint64.from_address(pointers[1]).value == 0x20000
    assert ctypes.c_int32.from_address(pointers[2]).value == 300
    assert ctypes.c_int32.from_address(pointers[3]).value == 64


def test_launch_shape_uses_the_recorded_block():
    launch = {"grid": [{"factors": [2560], "block": 128}, {"factors": ["tokens"], "block": 128},
                        {"factors": [1], "block": 1}],
              "threads": 384, "num_warps": 12, "shared": 98304}
    shape = shape_of(launch, {"tokens": 1000})
    assert shape.grid == (20, 8, 1) and shape.threads == 384 and shape.shared == 98304


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
