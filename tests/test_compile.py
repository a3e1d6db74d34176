"""Ahead-of-time compilation of the full-size Qwen3-4B config for sm_80, sm_90 and sm_120 on a machine with no
GPU with the Triton backend (tests/test_native_backends.py compiles the TileLang and CuTe DSL ones): cubins and
manifests, a second run that is all cache hits, a corrupted cubin found and rebuilt, and the
manifest's parameter ABI checked against each kernel's PTX entry."""

import re
from pathlib import Path

import pytest

from pegainfer.backends.build import build_model
from pegainfer.backends.manifest import graph_digest, load, pipeline_digest
from pegainfer.backends.spec import ParamKind
from pegainfer.cli import main
from pegainfer.frontends.load import embedded_configs, load_spec
from pegainfer.passes.pipeline import lower

SMS = [80, 90, 120]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("aot_cache")
    spec = load_spec(embedded_configs()["qwen3-4b"])
    return spec, cache, build_model(spec, SMS, jobs=2, cache_dir=cache, quiet=True, backends=["triton"])


def launches(manifest: Path):
    for kernel in load(manifest).kernels:
        for variant in kernel.variants:
            for launch in variant.launches:
                yield kernel, launch


def test_compile_writes_a_cubin_and_manifest_per_sm(built):
    spec, cache, report = built
    assert [p.parent.parent.name for p in report.manifests] == ["sm_80", "sm_90", "sm_120"]
    assert report.built > 0 and report.hits == 0
    lowered, _ = lower(spec.graph)
    for manifest in report.manifests:
        data = load(manifest)
        assert data.sm == int(manifest.parent.parent.name[3:]) and list(data.backends) == ["triton"]
        assert (data.pipeline_digest, data.graph_digest) == (pipeline_digest(), graph_digest(lowered))
        kinds = {k.kind for k in data.kernels}
        assert {"add_rms_norm_linear", "paged_attention", "lm_head_tail"} <= kinds
        for kernel, launch in launches(manifest):
            cubin = (manifest.parent.parent / launch.cubin).read_bytes()
            assert cubin[:4] == b"\x7fELF"
            assert launch.sha256 and launch.grid and kernel.ops


def test_manifest_abi_matches_the_ptx_entry(built):
    _, _, report = built
    for kernel, launch in launches(report.manifests[1]):
        ptx = (report.manifests[1].parent.parent / f"{launch.key}.ptx").read_text()
        entry = re.search(rf"\.entry {launch.symbol}\((.*?)\)", ptx, re.S).group(1)
        assert entry.count(".param") == len(launch.params), f"{kernel.node}: {launch.symbol}"
        assert [p.kind for p in launch.params[-2:]] == [ParamKind.SCRATCH, ParamKind.SCRATCH]


def test_programmatic_dependent_launch_only_where_the_sm_has_it(built):
    """sm_90 and later: the kernels that wait on their predecessor (griddepcontrol) say so in the manifest."""
    _, _, report = built
    for manifest in report.manifests:
        sm = load(manifest).sm
        for kernel, launch in launches(manifest):
            ptx = (manifest.parent.parent / f"{launch.key}.ptx").read_text()
            assert launch.pdl == ("griddepcontrol.wait" in ptx), f"sm_{sm} {kernel.node} {launch.symbol}"
            if sm < 90:
                assert not launch.pdl
        assert sm < 90 or any(launch.pdl for _, launch in launches(manifest))


def test_second_compile_is_all_cache_hits_and_a_corrupt_cubin_is_rebuilt(built):
    spec, cache, first = built
    second = build_model(spec, SMS, jobs=2, cache_dir=cache, quiet=True, backends=["triton"])
    assert second.built == 0 and second.hits == first.built
    _, launch = next(launches(second.manifests[1]))
    cubin = second.manifests[1].parent.parent / launch.cubin
    cubin.write_bytes(cubin.read_bytes()[:100])  # truncated
    third = build_model(spec, SMS, jobs=2, cache_dir=cache, quiet=True, backends=["triton"])
    assert third.built == 1
    assert (second.manifests[1].parent.parent / launch.cubin).read_bytes()[:4] == b"\x7fELF"


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


EARLY_KERNELS = ("qk_rope_kv_write_kernel", "paged_attention_split_kernel", "paged_attention_kernel")


def loads_around_the_wait(ptx: str) -> tuple[list[str], list[str]]:
    """The global loads of a kernel's PTX before and after its griddepcontrol.wait."""
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    loads = lambda text: re.findall(r"ld\.global[\w.]*", text)  # noqa: E731
    return loads(ptx[:wait]), loads(ptx[wait:])


def test_rope_and_attention_read_step_inputs_and_earlier_keys_before_waiting(built):
    """sm_90, where a kernel may start before the one it follows ends: RoPE / KV write reads the position, the slot
    and the norm's weights before waiting for that kernel (its output is the heads); attention reads the step's
    lengths before waiting, and the one-sequence split variant (PREFETCH) also the first tile's keys and values of
    earlier steps (vector loads), the queries and this step's keys after. Positions, slots, lengths and tables are
    step inputs (EARLY)."""
    _, _, report = built
    seen = set()
    for kernel, launch in launches(report.manifests[1]):
        if launch.symbol not in EARLY_KERNELS:
            continue
        assert launch.constexprs["EARLY"] is True, kernel.node
        before, after = loads_around_the_wait((report.manifests[1].parent.parent / f"{launch.key}.ptx").read_text())
        prefetch = launch.constexprs.get("PREFETCH", False)
        vectors = [load for load in before if ".v2" in load or ".v4" in load]
        if launch.symbol == "qk_rope_kv_write_kernel":
            assert len(before) >= 4 and len(after) >= 2, (before, after)  # pos, slot, w halves; the heads after
        elif prefetch:  # the lengths, the table; the keys' and values' rows
            assert len(vectors) >= 2 and len(after) >= len(vectors), (before, after)
        else:  # start, query and context lengths
            assert len(before) >= 3 and not vectors and len(after) >= 3, (before, after)
        seen.add((launch.symbol, prefetch))
    assert seen == {(name, False) for name in EARLY_KERNELS} | {("paged_attention_split_kernel", True)}


def test_without_early_inputs_the_wait_comes_before_every_load(built):
    """The same kernels planned with EARLY off (inputs a kernel might write): no global load before the wait."""
    import dataclasses

    from pegainfer.backends.build import compile_many, plan_model
    from pegainfer.backends.planning import PlanOptions

    _, kernels = plan_model(built[0], PlanOptions())
    late = {}
    for kernel in kernels:
        for variant in kernel.variants:
            for launch in variant.launches:
                if launch.function in EARLY_KERNELS and (90, launch.function) not in late:
                    late[(90, launch.function)] = dataclasses.replace(
                        launch, constexprs=launch.constexprs | {"EARLY": False} | (
                            {"PREFETCH": False} if "PREFETCH" in launch.constexprs else {}))
    assert {name for _, name in late} == set(EARLY_KERNELS)
    for (_, name), compiled in compile_many(late, 2, None):
        before, after = loads_around_the_wait(compiled.ptx)
        assert before == [] and after, (name, before)
