"""`pegainfer bench --result-file`: the report kept with its date, commit, card and command."""

import json
import re
import subprocess

import pytest

from pegainfer import __version__
from pegainfer.errors import PegainferError
from pegainfer.runtime import snapshot


def test_a_snapshot_names_the_commit_the_card_and_the_command(tmp_path):
    path = tmp_path / "decode.json"
    snapshot.write_snapshot(path, {"decode": [{"batch": 1, "ms_per_step": 2.5}]}, "NVIDIA H200",
                            ["bench", "decode", "qwen3-4b", "--batch", "1"])
    data = json.loads(path.read_text())
    assert data["decode"] == [{"batch": 1, "ms_per_step": 2.5}] and data["card"] == "NVIDIA H200"
    assert data["command"] == "pegainfer bench decode qwen3-4b --batch 1"
    head = subprocess.run(["git", "-C", str(snapshot.CHECKOUT), "rev-parse", "--short=7", "HEAD"],
                          capture_output=True, text=True)
    expected = head.stdout.strip() if head.returncode == 0 else __version__
    assert re.fullmatch(re.escape(expected) + r"(\+dirty)?", data["commit"]), (data["commit"], expected)


def test_outside_a_checkout_the_commit_is_the_package_version(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "CHECKOUT", tmp_path)
    assert snapshot.source_revision() == __version__


def test_an_unwritable_result_file_is_a_one_line_error(tmp_path):
    with pytest.raises(PegainferError, match="--result-file .*cannot write it"):
        snapshot.write_snapshot(tmp_path / "missing" / "r.json", {}, None, ["bench"])
