"""The build-to-runtime contract (backends/manifest.py), with no GPU and no compiler: a manifest dumps to readable
JSON and loads back equal; a missing, truncated or older manifest reads as none (compile rewrites it) and is
refused by name where the runtime loads it; parameter kinds are stored by name; the native compilers' ABI entries
are read into kinds; the variant rule is one for plans and manifests; and the lowering digest the build records is
the one the runtime computes for the same model."""

import json

import pytest

from pegainfer.backends.cache import read_manifest
from pegainfer.backends.manifest import (FORMAT, Kernel, Launch, Manifest, Selection, Variant, dump, graph_digest,
                                         load)
from pegainfer.backends.spec import GridDim, Param, ParamKind, TmaDescriptor, pick_variant
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.ir.types import TensorType

TMA = TmaDescriptor(9, (2560, "tokens"), (2, 5120), (64, 128), (1, 1), 0, 3, 2, 0)


def launch(key: str, params: tuple[Param, ...] = (), **fields) -> Launch:
    record = dict(function="gemm", module="gemm.py", params=params, constexprs={"N": 2560, "PDL": True, "B": None},
                  grid=(GridDim((2560,), 128), GridDim(("tokens",), 128), GridDim()), num_warps=12, num_stages=4,
                  backend="tilelang", deferred=False, key=key, cubin=f"{key}.cubin", sha256="ab" * 32,
                  symbol="gemm_kernel", shared=98304, threads=384, pdl=True)
    return Launch(**record | fields)


def sample_manifest() -> Manifest:
    params = (Param("A_desc", ParamKind.TMA, "x", "tma", tma=TMA), Param("P", ParamKind.PLANES, "o_proj", "*fp32"),
              Param("PR", ParamKind.PLANE_ROWS, "o_proj", "i32"), Param("M", ParamKind.DIM, "tokens", "i32"),
              Param("S", ParamKind.STRIDE, "block_tables", "i32", aligned=False))
    decode = Variant("decode_tile_16x16", 16, (launch("a", params, cluster=(1, 1, 2)),), "tilelang", {}, (90,))
    prefill = Variant("dot_64", None, (launch("b", deferred=True),), "triton", {"max_query_len": 64})
    normed = TensorType(dtype_from_name("bf16"), ("tokens", 2560))
    kernel = Kernel("body", "down", "linear", ("linear",), "tokens", [decode, prefill], [decode, prefill],
                    [Selection("rows<=16", ("tilelang:decode_tile_16x16",), "tuned", "tilelang:decode_tile_16x16",
                               {"tilelang:decode_tile_16x16": 7.5})], {"gemm.normed": normed}, {"gemm.normed": normed})
    return Manifest("Qwen3ForCausalLM", "Qwen3ForCausalLM-0123", "config.json", 90,
                    {"triton": "3.6.0", "tilelang": "0.1.15"}, 16, "p" * 16, "g" * 16, [kernel])


def test_a_manifest_loads_back_as_it_was_dumped_and_names_kinds_in_json(tmp_path):
    path = tmp_path / "m.json"
    dump(sample_manifest(), path)
    assert load(path) == sample_manifest()
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["kernels"][0]["variants"][0]["label"] == "tilelang:decode_tile_16x16"
    params = data["kernels"][0]["candidates"][0]["launches"][0]["params"]
    assert [(p["kind"], p["value"]) for p in params] == [("tma", "x"), ("planes", "o_proj"), ("plane_rows", "o_proj"),
                                                         ("dim", "tokens"), ("stride", "block_tables")]
    assert params[0]["tma"]["rank"] == 2 and params[0]["tma"]["dims"] == [2560, "tokens"]


def test_a_missing_truncated_or_older_manifest_reads_as_none_and_is_refused_by_name(tmp_path):
    path = tmp_path / "m.json"
    assert read_manifest(path) is None
    with pytest.raises(PegainferError, match="no such manifest"):
        load(path)
    dump(sample_manifest(), path)
    good = path.read_text()
    older = json.loads(good) | {"format": FORMAT - 1}
    for text, refusal in ((good[:200], "not a readable manifest"), (json.dumps(older), f"format {FORMAT - 1}"),
                          (good.replace('"graph_digest"', '"digest"'), "malformed manifest"),
                          (good.replace('"kind": "plane_rows"', '"kind": "rows:planes"'), "malformed manifest")):
        path.write_text(text)
        assert read_manifest(path) is None
        with pytest.raises(PegainferError, match=refusal) as refused:
            load(path)
        assert str(refused.value).startswith(f"{path}: ") and "pegainfer compile" in str(refused.value)


def test_native_abi_entries_read_into_parameter_kinds():
    """The TileLang and CuTe DSL compilers' entries, as Param.as_json writes them."""
    legacy = [{"name": "M", "kind": "dim", "value": "tokens", "dtype": "i32"},
              {"name": "MAXB", "kind": "stride", "value": "tables", "dtype": "i32"},
              {"name": "PR", "kind": "plane_rows", "value": "x2", "dtype": "i32"},
              {"name": "P", "kind": "planes", "value": "x2", "dtype": "*fp32"},
              {"name": "X", "kind": "tensor", "value": "x", "dtype": "*bf16"},
              {"name": "A_desc", "kind": "tma", "value": "x", "dtype": "tma", "tma": TMA.as_json()}]
    read = [Param.from_json(entry) for entry in legacy]
    assert [(p.kind, p.value, p.buffer) for p in read] == [
        (ParamKind.DIM, "tokens", None), (ParamKind.STRIDE, "tables", "tables"),
        (ParamKind.PLANE_ROWS, "x2", "planes:x2"), (ParamKind.PLANES, "x2", "planes:x2"),
        (ParamKind.TENSOR, "x", "x"), (ParamKind.TMA, "x", "x")]
    assert read[-1].tma == TMA
    assert [Param.from_json(p.as_json()) for p in read] == read


def test_one_variant_rule_for_a_manifest_kernel():
    (kernel,) = sample_manifest().kernels
    assert pick_variant(kernel, {"tokens": 16, "max_query_len": 1}).name == "decode_tile_16x16"
    assert pick_variant(kernel, {"tokens": 17, "max_query_len": 64}).name == "dot_64"
    with pytest.raises(AssertionError, match="no variant for tokens=17"):
        pick_variant(kernel, {"tokens": 17, "max_query_len": 1})


def test_the_runtime_lowers_a_checkpoint_to_the_graph_its_config_compiled_to(tiny_checkpoint):
    """`pegainfer compile` lowers the config alone; the engine lowers the loaded checkpoint's graph at start: the
    same digest, so a manifest compiled from either serves the other."""
    from pegainfer.frontends.load import load_model, load_spec
    from pegainfer.passes.pipeline import lower

    compiled = graph_digest(lower(load_spec(tiny_checkpoint / "config.json").graph)[0])
    assert compiled == graph_digest(lower(load_model(tiny_checkpoint, lazy=True).spec.graph)[0])
