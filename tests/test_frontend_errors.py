"""The frontend on bad input: every malformed or unsupported checkpoint gives a one-line ConfigError or
CheckpointError that names the file and the key or tensor. Also sharded checkpoints, embedded configs, and the
Qwen3-4B graph's parameter count."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pegainfer.errors import CheckpointError, ConfigError, PegainferError
from pegainfer.frontends.checkpoint import INDEX_FILE
from pegainfer.frontends.load import embedded_configs, load_model, load_spec, resolve_config_path


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny checkpoint, free to corrupt."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


def edit_config(folder: Path, change) -> Path:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))
    return path


def load_error(folder: Path, kind: type[PegainferError]) -> str:
    """load_model's error message, checked to be of `kind` and one line."""
    with pytest.raises(kind) as error:
        load_model(folder)
    message = str(error.value)
    assert "\n" not in message, message
    return message


# --- config.json ------------------------------------------------------------------------------------------------

def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    message = load_error(ckpt, ConfigError)
    assert str(ckpt / "config.json") in message


def test_config_json_not_valid_json(ckpt):
    (ckpt / "config.json").write_text('{"hidden_size": 64,')
    message = load_error(ckpt, ConfigError)
    assert str(ckpt / "config.json") in message and "not valid JSON" in message


def test_config_json_not_utf8(ckpt):
    (ckpt / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    message = load_error(ckpt, ConfigError)
    assert str(ckpt / "config.json") in message


def test_config_json_is_a_list(ckpt):
    (ckpt / "config.json").write_text("[1, 2, 3]")
    message = load_error(ckpt, ConfigError)
    assert str(ckpt / "config.json") in message and "list" in message


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers", "num_key_value_heads"])
def test_missing_required_key(ckpt, key):
    path = edit_config(ckpt, lambda c: c.pop(key))
    message = load_error(ckpt, ConfigError)
    assert str(path) in message and repr(key) in message and "missing" in message


@pytest.mark.parametrize("key,value,found", [
    ("hidden_size", "abc", "'abc'"),
    ("hidden_size", True, "True"),  # a bool is not an int here
    ("hidden_size", 64.5, "64.5"),
    ("rms_norm_eps", "small", "'small'"),
    ("tie_word_embeddings", "yes", "'yes'"),
    ("rope_scaling", 3, "3"),
])
def test_key_of_the_wrong_type(ckpt, key, value, found):
    path = edit_config(ckpt, lambda c: c.update({key: value}))
    message = load_error(ckpt, ConfigError)
    assert str(path) in message and repr(key) in message and found in message


def test_int_where_float_expected_is_accepted(ckpt):
    edit_config(ckpt, lambda c: c.update(rms_norm_eps=1, rope_theta=10000))
    model = load_model(ckpt)
    assert model.spec.config.rope_theta == 10000.0 and isinstance(model.spec.config.rope_theta, float)


def test_unknown_architecture(ckpt):
    path = edit_config(ckpt, lambda c: c.update(architectures=["FooForCausalLM"]))
    message = load_error(ckpt, ConfigError)
    assert str(path) in message and "FooForCausalLM" in message and "Qwen3ForCausalLM" in message


@pytest.mark.parametrize("value", [None, [], "Qwen3ForCausalLM", [3]])
def test_architectures_missing_or_malformed(ckpt, value):
    path = edit_config(ckpt, (lambda c: c.pop("architectures")) if value is None else
                       (lambda c: c.update(architectures=value)))
    message = load_error(ckpt, ConfigError)
    assert str(path) in message and "'architectures'" in message


@pytest.mark.parametrize("change,words", [
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["rope_scaling", "yarn"]),
    # transformers 5's spelling of the same thing
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     ["rope_scaling", "yarn"]),
    (lambda c: c.update(use_sliding_window=True), ["use_sliding_window"]),
    (lambda c: c.update(hidden_act="gelu"), ["hidden_act", "gelu"]),
    (lambda c: c.update(num_key_value_heads=3), ["num_key_value_heads", "num_attention_heads"]),
], ids=["rope_scaling", "rope_parameters", "sliding_window", "gelu", "kv_heads_not_divisor"])
def test_unsupported_settings(ckpt, change, words):
    path = edit_config(ckpt, change)
    message = load_error(ckpt, ConfigError)
    assert str(path) in message
    for word in words:
        assert word in message


def test_default_rope_parameters_are_not_scaling(ckpt):
    edit_config(ckpt, lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))
    config = load_model(ckpt).spec.config
    assert config.rope_scaling is None and config.rope_theta == 5000.0


def test_zero_kv_heads(ckpt):
    path = edit_config(ckpt, lambda c: c.update(num_key_value_heads=0))
    message = load_error(ckpt, ConfigError)
    assert str(path) in message and "num_key_value_heads" in message


def test_negative_hidden_size(ckpt):
    path = edit_config(ckpt, lambda c: c.update(hidden_size=-64))
    message = load_error(ckpt, ConfigError)
    assert str(path) in message and "hidden_size" in message


def test_zero_layers(ckpt):
    path = edit_config(ckpt, lambda c: c.update(num_hidden_layers=0))
    message = load_error(ckpt, ConfigError)
    assert str(path) in message and "num_hidden_layers" in message


@pytest.mark.parametrize("dtype", ["int8", "int32"])
def test_unknown_or_integer_dtype(ckpt, dtype):
    path = edit_config(ckpt, lambda c: c.update(dtype=dtype, torch_dtype=dtype))
    message = load_error(ckpt, ConfigError)
    assert str(path) in message and "dtype" in message.replace("unknown dtype", "")


# --- weights ----------------------------------------------------------------------------------------------------

def test_no_safetensors_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    message = load_error(ckpt, CheckpointError)
    assert str(ckpt) in message and "safetensors" in message


@pytest.mark.parametrize("content", [b"this is not a safetensors file" * 10, b"abc", b""],
                         ids=["garbage", "short", "empty"])
def test_garbage_safetensors_file(ckpt, content):
    (ckpt / "model.safetensors").write_bytes(content)
    message = load_error(ckpt, CheckpointError)
    assert str(ckpt / "model.safetensors") in message


def test_truncated_safetensors_file(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    message = load_error(ckpt, CheckpointError)
    assert str(ckpt / "model.safetensors") in message


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "model.norm.weight",
                                  "model.embed_tokens.weight"])
def test_missing_tensor(ckpt, name):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors[name]
    save_file(tensors, ckpt / "model.safetensors")
    message = load_error(ckpt, CheckpointError)
    assert repr(name) in message and "model.safetensors" in message and "missing" in message


def test_untied_config_needs_lm_head(ckpt):
    # The tiny checkpoint ties its head; declaring it untied makes the graph read lm_head.weight.
    edit_config(ckpt, lambda c: c.update(tie_word_embeddings=False))
    message = load_error(ckpt, CheckpointError)
    assert "'lm_head.weight'" in message and "model.safetensors" in message


def test_mis_shaped_tensor(ckpt):
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = load_file(ckpt / "model.safetensors")
    good = list(tensors[name].shape)
    tensors[name] = np.zeros((good[0] + 1, good[1]), dtype=tensors[name].dtype)
    save_file(tensors, ckpt / "model.safetensors")
    message = load_error(ckpt, CheckpointError)
    assert repr(name) in message and str(ckpt / "model.safetensors") in message
    assert str([good[0] + 1, good[1]]) in message and str(good) in message


def test_integer_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, ckpt / "model.safetensors")
    message = load_error(ckpt, CheckpointError)
    assert "'model.norm.weight'" in message and "I32" in message and str(ckpt / "model.safetensors") in message


def shard(folder: Path) -> dict[str, np.ndarray]:
    """Splits model.safetensors into two shards plus an index, as save_pretrained does for large models."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, folder / file)
        weight_map.update({n: file for n in part})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_sharded_checkpoint_loads_the_same_weights(tiny_checkpoint, ckpt):
    single = load_model(tiny_checkpoint).weights
    tensors = shard(ckpt)
    sharded = load_model(ckpt).weights
    assert sorted(sharded) == sorted(single)
    for name in single:
        assert np.array_equal(sharded[name], single[name]), name
        assert np.array_equal(sharded[name], tensors[name].astype(sharded[name].dtype)), name
    assert {f.name for f in ckpt.glob("*.safetensors")} == {"model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors"}


def test_sharded_checkpoint_missing_tensor_names_the_index(ckpt):
    shard(ckpt)
    shard_file = ckpt / "model-00002-of-00002.safetensors"
    tensors = load_file(shard_file)
    name = sorted(tensors)[0]
    del tensors[name]
    save_file(tensors, shard_file)
    message = load_error(ckpt, CheckpointError)
    assert repr(name) in message and INDEX_FILE in message


def test_index_names_a_shard_that_does_not_exist(ckpt):
    shard(ckpt)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00003-of-00003.safetensors"
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    message = load_error(ckpt, CheckpointError)
    assert "model-00003-of-00003.safetensors" in message and str(ckpt / INDEX_FILE) in message


@pytest.mark.parametrize("content", ["{", "[]", '{"metadata": {}}'], ids=["not_json", "list", "no_weight_map"])
def test_malformed_index(ckpt, content):
    shard(ckpt)
    (ckpt / INDEX_FILE).write_text(content)
    message = load_error(ckpt, CheckpointError)
    assert str(ckpt / INDEX_FILE) in message and "weight_map" in message


def test_index_weight_map_not_an_object(ckpt):
    shard(ckpt)
    (ckpt / INDEX_FILE).write_text('{"weight_map": ["model-00001-of-00002.safetensors"]}')
    message = load_error(ckpt, CheckpointError)
    assert str(ckpt / INDEX_FILE) in message and "weight_map" in message


def test_model_path_not_a_folder(tmp_path):
    message = load_error(tmp_path / "nowhere", ConfigError)
    assert str(tmp_path / "nowhere") in message


# --- embedded configs and resolve_config_path -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3-4b", "Qwen3-4B", "QWEN3-4b"])
def test_embedded_name_case_insensitive(name):
    path = resolve_config_path(name)
    assert path == embedded_configs()["qwen3-4b"] and path.name == "qwen3-4b.json" and path.is_file()
    spec = load_spec(path)
    assert spec.architecture == "Qwen3ForCausalLM" and spec.config.num_hidden_layers == 36
    assert spec.config.hidden_size == 2560


def test_embedded_configs_cover_the_qwen3_family():
    assert {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"} <= set(embedded_configs())


def test_unknown_embedded_name_lists_the_embedded_ones():
    with pytest.raises(ConfigError) as error:
        resolve_config_path("qwen9-1t")
    message = str(error.value)
    assert "\n" not in message and "qwen9-1t" in message and "qwen3-4b" in message and "qwen3-0.6b" in message


def test_resolve_folder_and_file(tiny_checkpoint):
    assert resolve_config_path(str(tiny_checkpoint)) == tiny_checkpoint / "config.json"
    assert resolve_config_path(str(tiny_checkpoint / "config.json")) == tiny_checkpoint / "config.json"


def parameter_count(spec) -> int:
    return sum(math.prod(t.shape) for t in spec.graph.expanded_params().values())


def test_qwen3_4b_parameter_count_matches_reference():
    spec = load_spec(resolve_config_path("qwen3-4b"))
    params = spec.graph.expanded_params()
    assert "lm_head.weight" not in params  # tied: the embedding is the head, counted once
    count = parameter_count(spec)
    assert f"{count:.3e}" == "4.022e+09", count  # the H200 reference's figure
    assert len(params) == 36 * 11 + 2


def test_untied_embedded_config_has_a_separate_head():
    spec = load_spec(resolve_config_path("qwen3-8b"))
    params = spec.graph.expanded_params()
    assert params["lm_head.weight"].shape == params["model.embed_tokens.weight"].shape == (151936, 4096)
