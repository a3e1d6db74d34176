"""Shared fixtures: small random checkpoints made once per session (they need torch and transformers)."""

import os
from pathlib import Path

# Triton fixes at import whether @triton.jit compiles or interprets. The tests interpret kernels on the CPU, in
# this process; `pegainfer compile` compiles in processes of its own.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

from golden_configs import QWEN3_CONFIGS
from pegainfer.fixtures.checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(name: str, overrides: dict | None = None, **kwargs) -> Path:
        if name not in made:
            made[name] = make_checkpoint(tmp_path_factory.mktemp(name), overrides=overrides or QWEN3_CONFIGS.get(name),
                                         **kwargs)
        return made[name]
    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory("tiny_tied")
