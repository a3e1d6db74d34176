"""Multimodal checkpoints served by their text stack (frontends/text_stack.py): their config.json's text_config is
the text model's, over its defaults; tensors under a language-model prefix bind to the text model's names; the
vision tower is left unread; and what cannot be read is a one-line error."""

import json
from pathlib import Path

import pytest

from pegainfer.errors import ConfigError
from pegainfer.frontends.checkpoint import TensorInfo
from pegainfer.frontends.load import load_spec, resolve_config_path
from pegainfer.frontends.text_stack import text_stack_tensors


def write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_every_embedded_qwen3_5_config_is_served_by_its_text_stack():
    for name, layers, full in (("qwen3.5-0.8b", 24, 6), ("qwen3.5-4b", 32, 8), ("qwen3.5-27b", 64, 16)):
        spec = load_spec(resolve_config_path(name))
        assert spec.text_stack and spec.architecture == "Qwen3_5ForConditionalGeneration"
        assert spec.config.num_hidden_layers == layers and spec.config.kinds().count("full_attention") == full
        assert spec.config.rotary_dim == 64  # 0.25 of head_dim 256
        states = spec.graph.expanded_states()
        assert len([s for s in states if s.endswith(".delta")]) == layers - full
        assert len([s for s in states if s.endswith(".k")]) == full


def test_a_wrapper_text_config_missing_keys_takes_the_text_models_defaults(tmp_path):
    text = {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 64}
    spec = load_spec(write(tmp_path, {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                                      "text_config": text, "torch_dtype": "bfloat16"}))
    assert (spec.config.vocab_size, spec.config.num_attention_heads, spec.config.num_key_value_heads) == (262208, 8, 4)
    assert spec.config.torch_dtype == "bfloat16" and spec.config.sliding_window == 64


@pytest.mark.parametrize("config,message", [
    ({"text_config": None}, "needs a 'text_config' object, found NoneType"),
    ({"text_config": {"model_type": "qwen3_5_moe_text"}}, "text_config's model_type must be 'qwen3_5_text', found "
                                                          "'qwen3_5_moe_text'"),
])
def test_a_wrapper_config_that_cannot_be_read_is_one_line(tmp_path, config, message):
    with pytest.raises(ConfigError, match=message):
        load_spec(write(tmp_path, {"architectures": ["Qwen3_5ForConditionalGeneration"], **config}))


def test_text_stack_tensors_take_the_text_models_names_and_leave_the_vision_tower_out():
    info = TensorInfo(Path("model.safetensors"), (4,), "BF16")
    names = ["model.language_model.layers.0.mlp.up_proj.weight", "language_model.model.norm.weight",
             "language_model.lm_head.weight", "model.visual.blocks.0.attn.qkv.weight", "vision_tower.x.weight",
             "mtp.fc.weight"]
    renamed = text_stack_tensors({name: info for name in names})
    assert {name: t.stored_name for name, t in renamed.items()} == {
        "model.layers.0.mlp.up_proj.weight": "model.language_model.layers.0.mlp.up_proj.weight",
        "model.norm.weight": "language_model.model.norm.weight", "lm_head.weight": "language_model.lm_head.weight"}
