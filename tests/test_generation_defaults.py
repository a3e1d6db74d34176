"""The checkpoint's generation_config.json gives a request's sampling defaults where it leaves them out (vLLM's
--generation-config auto), `--generation-config vllm` keeps the neutral ones, and a malformed value is the
checkpoint's error, named with its file."""

import json
import shutil

import pytest

from live_server import NAME, start_server, stop_server
from pegainfer.errors import CheckpointError
from pegainfer.runtime.tokenizer import sampling_defaults


@pytest.fixture(scope="module")
def greedy_checkpoint(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("greedy") / "ckpt"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0, "top_k": 20}))
    return folder


def texts(server, n: int, **body) -> list[str]:
    """n choices of 16 tokens: the chance that n samples at temperature 1 all equal greedy is negligible."""
    result = server.client().completions.create(model=NAME, prompt="The server", max_tokens=16, n=n,
                                                extra_body={"ignore_eos": True}, **body)
    return [choice.text for choice in result.choices]


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_generation_config_gives_the_defaults_unless_vllm_is_asked(greedy_checkpoint, tmp_path, mode):
    server = start_server(greedy_checkpoint, "--generation-config", mode, log=tmp_path / "serve.log")
    try:
        greedy = texts(server, 1, temperature=0)[0]
        defaulted = texts(server, 8)
        if mode == "auto":  # temperature 0 from the file: greedy, every time
            assert defaulted == [greedy] * 8
        else:  # the neutral temperature 1: samples that differ from greedy
            assert any(text != greedy for text in defaulted)
        assert texts(server, 1, temperature=0)[0] == greedy  # a field given wins over the file
    finally:
        stop_server(server)


def test_sampling_defaults_are_read_and_checked(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                                 "do_sample": True, "eos_token_id": 2}))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(CheckpointError, match="temperature must be a number"):
        sampling_defaults(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert sampling_defaults(tmp_path) == {}
