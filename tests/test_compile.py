"""Ahead-of-time compilation of the full-size Qwen3-4B config for sm_80, sm_90 and sm_120 on a machine with no
GPU with the Triton backend (tests/test_native_backends.py compiles the TileLang and CuTe DSL ones): cubins and
manifests, a second run that is all cache hits, a corrupted cubin found and rebuilt, and the
manifest's parameter ABI checked against each kernel's PTX entry."""

import json
import re
from pathlib import Path

import pytest

from pegainfer.backends.build import build_model
from pegainfer.cli import main
from pegainfer.frontends.load import embedded_configs, load_spec

SMS = [80, 90, 120]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("aot_cache")
    spec = load_spec(embedded_configs()["qwen3-4b"])
    return spec, cache, build_model(spec, SMS, jobs=2, cache_dir=cache, quiet=True, backends=["triton"])


def launches(manifest: Path):
    for kernel in json.loads(manifest.read_text())["kernels"]:
        for variant in kernel["variants"]:
            for launch in variant["launches"]:
                yield kernel, launch


def test_compile_writes_a_cubin_and_manifest_per_sm(built):
    _, cache, report = built
    assert [p.parent.parent.name for p in report.manifests] == ["sm_80", "sm_90", "sm_120"]
    assert report.built > 0 and report.hits == 0
    for manifest in report.manifests:
        data = json.loads(manifest.read_text())
        assert data["sm"] == int(manifest.parent.parent.name[3:]) and data["backend"] == "triton"
        kinds = {k["kind"] for k in data["kernels"]}
        assert {"add_rms_norm_linear", "paged_attention", "lm_head_tail"} <= kinds
        for kernel, launch in launches(manifest):
            cubin = (manifest.parent.parent / launch["cubin"]).read_bytes()
            assert cubin[:4] == b"\x7fELF"
            assert launch["sha256"] and launch["grid"] and kernel["ops"]


def test_manifest_abi_matches_the_ptx_entry(built):
    _, _, report = built
    for kernel, launch in launches(report.manifests[1]):
        ptx = (report.manifests[1].parent.parent / f"{launch['key']}.ptx").read_text()
        entry = re.search(rf"\.entry {launch['symbol']}\((.*?)\)", ptx, re.S).group(1)
        assert entry.count(".param") == len(launch["params"]), f"{kernel['node']}: {launch['symbol']}"
        assert [p["kind"] for p in launch["params"][-2:]] == ["scratch", "scratch"]


def test_programmatic_dependent_launch_only_where_the_sm_has_it(built):
    """sm_90 and later: the kernels that wait on their predecessor (griddepcontrol) say so in the manifest."""
    _, _, report = built
    for manifest in report.manifests:
        sm = json.loads(manifest.read_text())["sm"]
        for kernel, launch in launches(manifest):
            ptx = (manifest.parent.parent / f"{launch['key']}.ptx").read_text()
            assert launch["pdl"] == ("griddepcontrol.wait" in ptx), f"sm_{sm} {kernel['node']} {launch['symbol']}"
            if sm < 90:
                assert not launch["pdl"]
        assert sm < 90 or any(launch["pdl"] for _, launch in launches(manifest))


def test_second_compile_is_all_cache_hits_and_a_corrupt_cubin_is_rebuilt(built):
    spec, cache, first = built
    second = build_model(spec, SMS, jobs=2, cache_dir=cache, quiet=True, backends=["triton"])
    assert second.built == 0 and second.hits == first.built
    _, launch = next(launches(second.manifests[1]))
    cubin = second.manifests[1].parent.parent / launch["cubin"]
    cubin.write_bytes(cubin.read_bytes()[:100])  # truncated
    third = build_model(spec, SMS, jobs=2, cache_dir=cache, quiet=True, backends=["triton"])
    assert third.built == 1
    assert (second.manifests[1].parent.parent / launch["cubin"]).read_bytes()[:4] == b"\x7fELF"


def test_cli_compile_and_inspect_compiled_kernels(built, capsys):
    _, cache, report = built
    assert main(["compile", "qwen3-4b", "--sm", "90", "--backends", "triton", "--cache-dir", str(cache)]) == 0
    assert "0 compiled" in capsys.readouterr().err
    assert main(["inspect", "qwen3-4b", "--sm", "90", "--kernel", "down", "--show", "sass",
                 "--cache-dir", str(cache)]) == 0
    assert "Function : linear_kernel" in capsys.readouterr().out
    assert main(["inspect", "qwen3-4b", "--sm", "90", "--show", "resources", "--cache-dir", str(cache)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == len(list(launches(report.manifests[1])))
    assert all(int(row.split()[3]) > 0 for row in rows), "every launch uses registers"
    assert main(["inspect", "qwen3-4b", "--sm", "90", "--kernel", "embedding", "--show", "source",
                 "--cache-dir", str(cache)]) == 0
    assert "def embedding_kernel(" in capsys.readouterr().out


def test_compile_without_a_gpu_asks_for_sm(capsys):
    assert main(["compile", "qwen3-4b"]) == 1
    assert "no GPU is visible here: name the target with --sm" in capsys.readouterr().err
