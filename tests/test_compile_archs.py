"""`pegainfer compile <config> --sm 90` on a machine with no GPU for every architecture besides Qwen3 (whose
full-size compile is test_compile's): each small config lowers, every launch compiles to a cubin, and the
manifest carries what makes each architecture itself (windows, RoPE scaling, norm offsets, the MoE and latent
attention kernels)."""

import json
from pathlib import Path

import pytest

from pegainfer.backends.manifest import load
from pegainfer.cli import main
from pegainfer.frontends.registry import dag_modules

pytestmark = pytest.mark.slow

# constexprs that must appear in some launch of the architecture's manifest
EXPECTED = {
    "LlamaForCausalLM": {"SCALING": 2},
    "Qwen2ForCausalLM": {"BIAS": True},
    "MistralForCausalLM": {"WINDOW": 7},
    "Gemma3ForCausalLM": {"WINDOW": 6, "SCALING": 1, "NORM_OFFSET": 1.0, "ACT": 2, "SCALE": 8.0},
    "Qwen3MoeForCausalLM": {"NORMALIZE": False, "INTER": 32},
    "Qwen3_5ForCausalLM": {"ROT": 4, "CHUNK": 32, "WIDTH": 4, "NORM_OFFSET": 1.0},
    "Qwen3_5MoeForCausalLM": {"ROT": 4, "CHUNK": 32, "NORMALIZE": True, "INTER": 32},
    "DeepseekV2ForCausalLM": {"INTERLEAVED": True, "SIGMOID": False, "INTER": 32},
    "DeepseekV3ForCausalLM": {"INTERLEAVED": True, "SIGMOID": True, "GROUP_TOP2": True, "TOPK_GROUP": 2},
}


def test_every_architecture_compiles_for_sm90(tmp_path, capsys):
    text_models = {a for module in dag_modules().values() for a in module.ARCHITECTURES}
    assert set(EXPECTED) | {"Qwen3ForCausalLM"} == text_models, "a new DAG file needs its compile check"
    cache = tmp_path / "cache"
    for architecture, expected in EXPECTED.items():
        config = tmp_path / architecture / "config.json"
        config.parent.mkdir()
        config.write_text(json.dumps(dag_modules()[architecture].TINY_CONFIG))
        assert main(["compile", str(config), "--sm", "90", "--jobs", "2", "--cache-dir", str(cache)]) == 0
        err = capsys.readouterr().err
        manifest = Path(err.split("manifest ")[-1].strip())
        data = load(manifest)
        assert data.sm == 90 and data.model.startswith(architecture)
        constexprs = {}
        for kernel in data.kernels:
            for variant in kernel.variants:
                for launch in variant.launches:
                    assert (manifest.parent.parent / launch.cubin).read_bytes()[:4] == b"\x7fELF"
                    for key, value in launch.constexprs.items():
                        constexprs.setdefault(key, set()).add(value)
        for key, value in expected.items():
            assert value in constexprs.get(key, set()), f"{architecture}: no launch with {key}={value}"
        if architecture == "Qwen3MoeForCausalLM":
            assert {"moe_route", "moe_experts"} <= {k.kind for k in data.kernels}
        if architecture.startswith("Deepseek"):
            assert {"latent_write", "latent_attention", "head_linear", "moe_experts"} <= {k.kind for k in data.kernels}
        if architecture == "Qwen3_5ForCausalLM":
            assert {"causal_conv1d", "gated_delta_rule"} <= {k.kind for k in data.kernels}
