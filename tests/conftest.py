"""Shared fixtures: small random checkpoints made once per session (they need torch and transformers)."""

import os
from pathlib import Path

# Triton fixes at import whether @triton.jit compiles or interprets. The tests interpret kernels on the CPU, in
# this process; `pegainfer compile` compiles in processes of its own.
os.environ["TRITON_INTERPRET"] = "1"

import pytest

from golden_configs import GOLDEN_CONFIGS
from pegainfer.fixtures.checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(name: str, overrides: dict | None = None, **kwargs) -> Path:
        """A named configuration of golden_configs (its architecture and overrides), or `overrides` of Qwen3's."""
        if name not in made:
            architecture, known = GOLDEN_CONFIGS.get(name, ("Qwen3ForCausalLM", None))
            kwargs.setdefault("architecture", architecture)
            made[name] = make_checkpoint(tmp_path_factory.mktemp(name), overrides=overrides or known, **kwargs)
        return made[name]
    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory("tiny_tied")
