"""The GPU scripts' argument checks, which run before anything needs a GPU: a bad flag ends the run with a
one-line message and exit status 2, not a traceback or a run that quietly does nothing."""

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "gpu"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


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


def test_kernels_refuses_a_negative_sustain_and_an_unknown_kernel(tmp_path):
    """kernels.py's checks come before it touches the GPU: a negative --sustain, and a --nodes name the plan has no
    kernel of (the message lists the kernels there are)."""
    done = run(str(SCRIPTS / "kernels.py"), "--out", str(tmp_path / "k"), "--sustain", "-1")
    assert done.returncode == 2 and "--sustain: seconds must not be negative, got -1.0" in done.stderr
    done = run(str(SCRIPTS / "kernels.py"), "--out", str(tmp_path / "k"), "--nodes", "no_such_kernel")
    assert done.returncode == 2 and "--nodes: no kernel named ['no_such_kernel']; the kernels: [" in done.stderr
    assert "'o_proj'" in done.stderr
