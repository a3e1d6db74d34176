"""The W8A8 prefill path of FP8 weights on sm_90a: the rows' quantization (ir/ops/quantize.py `quantize_row_groups`,
which rows.py `quantize_rows` implements) rounds each group to the nearest e4m3 with its largest magnitude at 448,
and a product of such rows stays within the bound its rounding allows; the plan gives each FP8 GEMM of the Qwen3-4B
shape (128 x 128 blocks, and a scale per channel) the quantizing row launch and an e4m3 wgmma tile in every slot
(the rows as M at any rows, the weights as M at decode rows), and Triton's W8A16 tiles where the blocks have no
form; the tiles compile for sm_90a to QGMMA on e4m3 operands fed by TMA, no spills.
The kernels' numerics against the same arithmetic in torch: scripts/gpu/w8a8_check.py, on the H200."""

import json

import ml_dtypes
import numpy as np
import pytest

from pegainfer.backends.build import plan_model
from pegainfer.backends.planning import PlanOptions
from pegainfer.frontends.load import embedded_configs, load_spec
from pegainfer.ir.ops.quantize import E4M3_MAX, quantize_row_groups

E4M3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
FINITE = np.unique(E4M3[np.isfinite(E4M3)])
GEMMS = ("qkv", "o_proj", "gate_up", "down")


def rows_with_spread(seed: int, rows: int = 6, cols: int = 512) -> np.ndarray:
    """Rows whose 128-column groups differ in magnitude by up to 2^20, one group all zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-10, 10, (rows, cols // 128)).repeat(128, axis=1)
    x[1, 128:256] = 0
    return x.astype(np.float32)


def test_each_group_rounds_to_the_nearest_e4m3_with_its_largest_magnitude_at_448():
    x = rows_with_spread(0)
    values, scales = quantize_row_groups(x)
    assert values.dtype == ml_dtypes.float8_e4m3fn and scales.shape == (6, 4) and scales.dtype == np.float32
    scaled = (x.reshape(6, 4, 128) / scales[:, :, None].astype(np.float64)).reshape(6, 512)
    nearest = FINITE[np.abs(scaled[..., None] - FINITE).argmin(axis=-1)]
    got = values.astype(np.float64)
    tie = np.isclose(np.abs(scaled[..., None] - FINITE), np.abs(scaled - nearest)[..., None]).sum(-1) > 1
    assert np.array_equal(got[~tie], nearest[~tie])  # ties: to even, as the cast does
    peaks = np.abs(got.reshape(6, 4, 128)).max(axis=2)
    assert np.all(peaks[scales > 1e-10 / E4M3_MAX] == E4M3_MAX)
    assert np.all(got[1, 128:256] == 0) and scales[1, 1] == np.float32(1e-10) / np.float32(E4M3_MAX)


def test_a_w8a8_product_stays_within_the_bound_its_rounding_allows():
    """Bound: e4m3 keeps 3 mantissa bits, so a normal value (scaled magnitude >= 2^-6) rounds within 2^-4 of itself
    and a subnormal one within half its spacing 2^-9; per output, |y - y~| <= sum_i |x_i - x~_i| |w_i| <=
    sum_i (2^-4 |x_i| + 2^-10 s_g(i)) |w_i|. The weights are as the checkpoint means them (dequantized), so only
    the rows' rounding is measured."""
    x = rows_with_spread(1)
    w = np.random.default_rng(2).standard_normal((96, 512)).astype(np.float32)
    values, scales = quantize_row_groups(x)
    rounded = values.astype(np.float64) * scales.astype(np.float64).repeat(128, axis=1)
    error = np.abs(rounded @ w.T.astype(np.float64) - x.astype(np.float64) @ w.T)
    bound = (2.0 ** -4 * np.abs(x) + 2.0 ** -10 * scales.repeat(128, axis=1)) @ np.abs(w.T)
    assert np.all(error <= bound * (1 + 1e-6))
    # random signs: the errors mostly cancel, a few percent of the bound
    assert np.median(error / bound) < 0.1


@pytest.fixture(scope="module", params=[("qwen3-4b-fp8", None), ("qwen3-4b", "fp8")], ids=["block", "channel"])
def fp8_kernels(request):
    name, quantization = request.param
    spec = load_spec(embedded_configs()[name], quantization=quantization)
    return request.param, plan_model(spec, PlanOptions(), ("triton", "tilelang"))[1]


def test_every_fp8_gemm_gets_the_w8a8_tile_at_any_rows_and_the_swapped_tiles_at_decode_rows(fp8_kernels):
    (name, _), kernels = fp8_kernels
    mode = 2 if name == "qwen3-4b-fp8" else 1
    for kernel in (k for k in kernels if k.node in GEMMS):
        tilelang = [v for v in kernel.variants if v.backend == "tilelang"]
        prefill = [v for v in tilelang if v.max_rows is None]
        assert [v.name for v in prefill] == ["w8a8_merged_128x128" if kernel.node == "gate_up" else "w8a8_128x128"]
        quantize, product = prefill[0].launches
        assert (quantize.function, product.function) == ("quantize_rows", "gemm_fp8")
        assert quantize.constexprs["NORM"] == (kernel.node in ("qkv", "gate_up"))
        assert product.constexprs["SCALE"] == mode and product.constexprs["ACT"] == (kernel.node == "gate_up")
        k = product.constexprs["K"]
        assert kernel.scratch["gemm.quantized"] == ("f8e4m3", ("tokens", k))
        assert kernel.scratch["gemm.row_scales"] == ("f32", ("tokens", k // 128))
        # decode slots: the swapped tile after the quantizing launch, programmatic, K split where CTAs are few
        decode = [v for v in tilelang if v.max_rows is not None]
        assert [v.max_rows for v in decode] == [1, 4, 16, 32, 64, 128, 256], kernel.node
        for variant in decode:
            functions = [launch.function for launch in variant.launches]
            assert variant.name.startswith("w8a8_swapped_") and functions in (
                ["quantize_rows", "swapped_fp8"], ["quantize_rows", "swapped_fp8", "sum_slices"]), functions
            quantized, tile = variant.launches[:2]
            assert quantized.constexprs["PDL"] and tile.constexprs["PDL"]
            assert tile.constexprs["SPLIT"] == (1 if len(functions) == 2 else variant.launches[2].constexprs["SPLIT"])
            block_m = tile.constexprs["BLOCK_M"]
            assert min(variant.max_rows, 16) <= block_m <= (64 if kernel.node == "gate_up" else 128)


def test_fp8_blocks_the_tile_has_no_form_for_stay_with_triton(tmp_path):
    config = json.loads(embedded_configs()["qwen3-4b-fp8"].read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (tmp_path / "config.json").write_text(json.dumps(config))
    kernels = plan_model(load_spec(tmp_path / "config.json"), PlanOptions(), ("triton", "tilelang"))[1]
    gemms = [k for k in kernels if k.node in GEMMS]
    assert len(gemms) == 4 and not [v for k in gemms for v in k.variants if v.backend == "tilelang"]


def test_a_norm_that_scales_by_one_plus_weight_reaches_the_quantizing_launch(tmp_path):
    """Gemma 3's QKV under --quantization fp8 (at a width the tiles take): its RMSNorm scales by 1 + weight, so the
    quantizing row launch before each W8A8 tile norms with NORM_OFFSET=1.0; the launches with no norm take 0.0."""
    config = json.loads(embedded_configs()["gemma-3-1b"].read_text()) | {"hidden_size": 1024}
    (tmp_path / "config.json").write_text(json.dumps(config))
    kernels = plan_model(load_spec(tmp_path / "config.json", quantization="fp8"), PlanOptions(),
                         ("triton", "tilelang"))[1]
    quantized = {(k.node.split(".")[0], launch.constexprs["NORM"], launch.constexprs["NORM_OFFSET"])
                 for k in kernels for v in k.variants for launch in v.launches if launch.function == "quantize_rows"}
    assert quantized == {("qkv", True, 1.0), ("o_proj", False, 0.0), ("down", False, 0.0)}, quantized


@pytest.mark.slow
def test_w8a8_tiles_compile_for_sm90a_to_qgmma_on_e4m3_fed_by_tma(tmp_path):
    pytest.importorskip("tilelang")
    from pegainfer.backends.build import compile_many

    from tests.test_native_backends import sass

    spec = load_spec(embedded_configs()["qwen3-4b-fp8"])
    kernels = plan_model(spec, PlanOptions(), ("triton", "tilelang"))[1]
    chosen = {"w8a8_128x128", "w8a8_merged_128x128", "w8a8_swapped_16x64"}
    todo = {(90, f"{k.node}/{v.name}/{launch.function}"): launch for k in kernels if k.node in ("gate_up", "down")
            for v in k.variants if v.name in chosen for launch in v.launches if launch.function != "sum_slices"}
    results = dict(compile_many(todo, 2, None))
    assert len(results) == 8, sorted(results)
    for key, native in results.items():
        assert native.resources["spill_stores"] == 0 and native.resources["spill_loads"] == 0, key
        code = sass(native.cubin, tmp_path)
        function = key[1].rsplit("/", 1)[1]
        if function == "gemm_fp8":  # e4m3 x e4m3 wgmma, the rows and weights by TMA, registers handed over
            assert "QGMMA.64x128x32.F32.E4M3.E4M3" in code and "UTMALDG" in code, key
            assert "HGMMA" not in code and native.threads == 384, key
        elif function == "swapped_fp8":  # the weights as wgmma's A: 64 columns by the rows' 16
            assert "QGMMA.64x16x32.F32.E4M3.E4M3" in code and "UTMALDG" in code, key
        elif function == "quantize_rows":  # saturating: the scale's division can reach past 448 by a rounding
            assert "F2FP.SATFINITE.E4M3" in code, key


@pytest.mark.slow
def test_the_longest_k_of_the_qwen3_sizes_fits_an_sm(tmp_path):
    """Qwen3-32B's down (K = 25600): the prefill tile holds its rows' scales whole beside its stages, the decode
    tiles too; each within the 227 KB a CTA may take (and the two-CTA decode tiles within half an SM)."""
    pytest.importorskip("tilelang")
    from pegainfer.backends.build import compile_many

    spec = load_spec(embedded_configs()["qwen3-32b-fp8"])
    (down,) = [k for k in plan_model(spec, PlanOptions(), ("triton", "tilelang"))[1] if k.node == "down"]
    chosen = {v.name: v for v in down.variants if v.backend == "tilelang"}
    todo = {(90, name): v.launches[1] for name, v in chosen.items()}
    todo[(90, "rows")] = chosen["w8a8_128x128"].launches[0]
    for (_, name), native in compile_many(todo, 2, None):
        assert native.shared + native.resources["shared"] <= 227 * 1024, (name, native.shared)
        assert native.resources["spill_stores"] == 0, name
        if name != "rows" and todo[(90, name)].constexprs.get("MIN_BLOCKS", 1) == 2:
            assert 2 * (native.shared + native.resources["shared"]) <= 228 * 1024, (name, native.shared)
