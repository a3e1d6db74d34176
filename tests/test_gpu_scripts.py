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
