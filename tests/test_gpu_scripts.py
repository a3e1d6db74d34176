"""The GPU scripts' argument checks, which run before anything needs a GPU: a bad flag ends the run with a
one-line message and exit status 2, not a traceback or a run that quietly does nothing."""

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "gpu"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_gemm_probe_refuses_an_unknown_case_label(tmp_path):
    done = run(str(SCRIPTS / "gemm_probe.py"), "prepare", "--out", str(tmp_path / "probe"), "--only", "no_such_case")
    assert done.returncode == 2
    assert "--only: no case labelled ['no_such_case']" in done.stderr and "plain_128x256 N19456" in done.stderr
    assert not (tmp_path / "probe").exists()


def test_gemm_probe_refuses_a_negative_sustain(tmp_path):
    done = run(str(SCRIPTS / "gemm_probe.py"), "run", "--dir", str(tmp_path), "--out", str(tmp_path), "--sustain", "-1")
    assert done.returncode == 2 and "--sustain: seconds must not be negative, got -1.0" in done.stderr


def test_gemm_probe_decode_cases_launch_what_their_template_declares(gemm_probe):
    """A split decode case passes the fp32 planes and tickets (a cluster's none: its CTAs meet in shared memory; a
    partial one its planes, its output, alone) and
    launches SPLIT CTAs along z, a swapped one a row tile of SWAP_ROWS along y (a halved one 4 rows and 8 columns,
    each over both K halves); every decode case (decode_gemm.py's
    and gemm.py's tiles) covers N with whole tiles and K with whole steps of each split, and its stages fit the
    shared memory of the CTAs it asks an SM to hold."""
    decode = [c for c in gemm_probe.CASES if c.decode and c.function != "add_rms_norm"]
    assert {6144, 2560, 9728} <= {c.n for c in decode}  # the 4B model's, and the probe's own widths beside them
    assert any(c.tile.get("NORM") for c in decode) and any(c.tile.get("CLUSTER") for c in decode)
    assert any(c.tile.get("HALVES") for c in decode) and any(c.tile.get("PARTIAL") for c in decode)
    for case in decode:
        launch, tile = gemm_probe.launch_spec(case), case.tile
        split, norm, halves = tile.get("SPLIT", 1), tile.get("NORM", False), tile.get("HALVES", False)
        names = [p.name for p in launch.params]
        planes = split > 1 and not tile.get("CLUSTER")
        expected = ["A", "W", "C", "P", "tickets", "M"] if planes else ["A", "W", "C", "M"]
        if tile.get("PARTIAL"):  # the planes are its output
            expected = ["A", "W", "P", "M"]
        assert names == (["A", "X2", "G", "S", "W", "C", "M"] if norm else expected), case.label
        assert launch.grid[2].factors == (split,) and case.n % tile["BLOCK_N"] == 0
        # a normed tile covers 4 rows: its 8-row stage holds X2's 4, then each product's low half; a halved one 4
        # rows over both K halves, and 8 weight rows over both
        rows = 4 if norm or halves else (tile.get("BLOCK_M") or tile.get("SWAP_ROWS") or 16)
        assert launch.grid[1].block == rows, case.label
        assert launch.grid[0].block == tile["BLOCK_N"] // (2 if halves else 1), case.label
        warpgroups = 1 + norm  # decode_gemm.py's producer, and a normed tile's scalers
        assert launch.num_warps * 32 == tile["THREADS"] + (128 * warpgroups if case.function == "decode_gemm" else 0)
        assert case.k % (tile["BLOCK_K"] * split * (2 if halves else 1)) == 0, case.label
        rows = tile.get("SWAP_ROWS") or 16  # a swapped tile stages 8 rows where mma's A operand needs 16
        stage = (rows + tile["BLOCK_N"] * (2 if case.act else 1)) * tile["BLOCK_K"] * 2
        # a CTA's static shared memory (the barriers: 1 KB), the system's 1 KB beside its stages; a normed tile's G
        # and about 2 KB more (the scalers' reduction, 1/rms and the products' exchange)
        dynamic = tile["STAGES"] * stage + (case.k * 2 + 2048 if norm else 0)
        assert tile["MIN_BLOCKS"] * (dynamic + 2048) <= 228 * 1024, case.label


def test_gemm_probe_paired_cases_follow_the_norm_launch_that_writes_their_rows(gemm_probe):
    """A paired case is timed after rows.py's norm launch of X and X2's planes: that launch writes the case's rows
    (A) from X, X2 as stored or its planes, and G, and the sum to S, at the case's K."""
    norms = [c for c in gemm_probe.CASES if c.function == "add_rms_norm"]
    paired = [c for c in gemm_probe.CASES if c.paired]
    assert len(norms) == 1 and paired and all(c.k == norms[0].k and c.decode for c in paired)
    launch = gemm_probe.launch_spec(norms[0])
    assert [(p.name, p.value) for p in launch.params] == [
        ("X", "x"), ("X2", "x2"), ("G", "g"), ("S", "s"), ("Y", "a"), ("M", "dim:tokens"), ("P", "xp"),
        ("PR", "rows:xp")]
    assert launch.constexprs["PLANES"] == 4 and launch.constexprs["PDL"] and launch.module == "rows.py"
    assert all(gemm_probe.launch_spec(c).params[0].value == "a" for c in paired)


def test_gemm_probe_refuses_a_selection_of_no_case(tmp_path):
    """--decode with only prefill labels would compile nothing and leave a run with nothing to time."""
    done = run(str(SCRIPTS / "gemm_probe.py"), "prepare", "--out", str(tmp_path / "probe"), "--decode",
               "--only", "plain_128x256 N19456")
    assert done.returncode == 2
    assert "no case to compile: --only ['plain_128x256 N19456'] with --decode selects none" in done.stderr
    assert not (tmp_path / "probe").exists()


def test_gemm_probe_merge_keeps_each_label_once_grouped_by_shape(tmp_path):
    """`merge` copies several prepared folders into one: the first folder's case of a label wins, the cases come
    grouped by shape (the run makes one shape's weight copies at a time), and each launch names its copied cubin."""
    import json

    def folder(name: str, cases: list[tuple[str, int, bytes]]) -> Path:
        path = tmp_path / name
        path.mkdir()
        index = []
        for i, (label, n, cubin) in enumerate(cases):
            (path / f"case{i}.cubin").write_bytes(cubin)
            index.append({"case": {"label": label, "n": n, "k": 256, "act": 0},
                          "launch": {"key": f"case{i}.cubin", "cubin": f"case{i}.cubin"}})
        (path / "index.json").write_text(json.dumps(index))
        return path

    first = folder("a", [("qkv x", 6144, b"qkv-a"), ("o_proj x", 2560, b"o-a")])
    second = folder("b", [("qkv y", 6144, b"qkv-b"), ("o_proj x", 2560, b"o-b"), ("down y", 2560, b"down-b")])
    done = run(str(SCRIPTS / "gemm_probe.py"), "merge", "--out", str(tmp_path / "m"), str(first), str(second))
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "m" / "index.json").read_text())
    assert [e["case"]["label"] for e in index] == ["qkv x", "qkv y", "o_proj x", "down y"]
    cubins = [(tmp_path / "m" / e["launch"]["cubin"]).read_bytes() for e in index]
    assert cubins == [b"qkv-a", b"qkv-b", b"o-a", b"down-b"]
    assert [e["launch"]["key"] for e in index] == [e["launch"]["cubin"] for e in index]


def test_gemm_probe_merge_refuses_a_folder_never_prepared(tmp_path):
    done = run(str(SCRIPTS / "gemm_probe.py"), "merge", "--out", str(tmp_path / "m"), str(tmp_path))
    assert done.returncode == 2 and f"merge: no index.json (a `prepare --out` folder) in ['{tmp_path}']" in done.stderr
    assert not (tmp_path / "m").exists()


def test_gemm_probe_merge_refuses_to_write_into_a_folder_it_reads(tmp_path):
    (tmp_path / "index.json").write_text("[]")
    done = run(str(SCRIPTS / "gemm_probe.py"), "merge", "--out", str(tmp_path), str(tmp_path))
    assert done.returncode == 2 and f"merge: --out {tmp_path} is one of the folders merged" in done.stderr


def test_probe_best_lists_the_fastest_matching_cases_and_flags_the_wrong_ones(tmp_path):
    """probe_best.py: per GEMM and row count, the fastest cases whose output matched torch's, plain and PDL, with
    their share of the copy bandwidth; a case that failed or read wrong values is named, never ranked."""
    import json

    def row(case, us, pdl_us, rel_err=1.6e-3, **more):
        return dict(case=case, rows=4, n=2560, k=4096, us=us, pdl_us=pdl_us, rel_err=rel_err, pdl_rel_err=rel_err,
                    **more)

    probe = {"copy_tb_per_s": 4.0, "rows": [row("o_proj a", 8.0, 7.0), row("o_proj b", 9.0, 6.0),
                                            row("o_proj wrong", 1.0, 1.0, rel_err=0.5),
                                            {"case": "o_proj broken", "rows": 4, "error": "RuntimeError: boom"}]}
    (tmp_path / "decode_probe.json").write_text(json.dumps(probe))
    done = run(str(SCRIPTS / "probe_best.py"), str(tmp_path / "decode_probe.json"), "--top", "2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "WRONG o_proj wrong rows 4: (0.5, 0.5)" in lines
    assert "WRONG o_proj broken rows 4: RuntimeError: boom" in lines
    # 2560 x 4096 bf16 = 20.97 MB: in 8 us 2.62 TB/s, 66% of 4 TB/s
    assert "o_proj   4 plain a 8.0 (66%), b 9.0 (58%)" in lines and "o_proj   4 PDL   b 6.0 (87%), a 7.0 (75%)" in lines


def test_probe_best_refuses_a_missing_file(tmp_path):
    done = run(str(SCRIPTS / "probe_best.py"), str(tmp_path / "none.json"))
    assert done.returncode == 2 and f"no such file: {tmp_path / 'none.json'}" in done.stderr


def test_step_profile_refuses_a_batch_below_one_and_a_machine_without_a_gpu(tmp_path):
    done = run(str(SCRIPTS / "step_profile.py"), "qwen3-4b", "--batch", "1", "0", "--out", str(tmp_path / "p"))
    assert done.returncode == 2 and "--batch: at least 1, got 0" in done.stderr
    done = run(str(SCRIPTS / "step_profile.py"), "qwen3-4b", "--out", str(tmp_path / "p"))  # this machine: no GPU
    assert done.returncode == 2 and "needs a visible GPU" in done.stderr
    assert not (tmp_path / "p").exists()


def test_step_profile_charges_each_kernel_what_it_moved_the_step_end(tmp_path):
    """step_profile.py's summary of a trace: each kernel is charged from the previous kernel's end to its own (an
    overlapping one, waiting on its predecessor under programmatic launch, only past that end), so that the charges
    add up to the step's span; idle gaps are counted apart; kernels of one name but different grids are kept apart;
    figures are medians over the steps."""
    import importlib.util
    import json
    spec = importlib.util.spec_from_file_location("step_profile", SCRIPTS / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = lambda name, grid, start, end: {"cat": "kernel", "name": name, "ts": start, "dur": end - start,  # noqa
                                             "args": {"grid": grid}}
    events = [kernel("gemv", [1, 8, 1], 0, 10), kernel("attend", [1, 1, 1], 5, 20), kernel("gemv", [1, 4, 1], 22, 30),
              kernel("gemv", [1, 8, 1], 40, 50), kernel("attend", [1, 1, 1], 45, 61),
              kernel("gemv", [1, 4, 1], 61, 70), {"cat": "gpu_memcpy", "name": "copy", "ts": 35, "dur": 3}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events[::-1]}))  # records in any order
    kernels = module.kernel_records(trace)
    assert len(kernels) == 6 and [k["start"] for k in kernels] == [0, 5, 22, 40, 45, 61]
    summary = module.summarise(module.split_steps(kernels, 3))
    assert summary["steps"] == 2 and summary["span_us"] == 30 and summary["idle_us"] == 2
    rows = {(r["name"], tuple(r["grid"])): r for r in summary["kernels"]}
    assert rows[("gemv", (1, 8, 1))]["charged_us"] == 10 and rows[("attend", (1, 1, 1))]["charged_us"] == 11
    assert rows[("gemv", (1, 4, 1))]["charged_us"] == 10 and rows[("attend", (1, 1, 1))]["ran_us"] == 16
    assert all(r["launches"] == 1 for r in summary["kernels"])
