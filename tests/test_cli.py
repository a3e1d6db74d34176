"""The `pegainfer` command, mostly in-process through pegainfer.cli.main, once through the installed script."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from pegainfer.cli import main
from pegainfer.frontends.load import load_model

PROMPT = "1,2,3"


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generate(capsys, model: Path, *args: str) -> dict:
    code, out, err = run(capsys, "generate", "--model-path", model, "--json", *args)
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1, out  # one JSON object, one line
    return json.loads(out)


def one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pegainfer: error: "), err
    return lines[0]


# --- generate ---------------------------------------------------------------------------------------------------

def test_generate_json(capsys, tiny_checkpoint):
    result = generate(capsys, tiny_checkpoint, "--prompt-ids", PROMPT, "--max-tokens", "7", "--ignore-eos")
    assert result["prompt_token_ids"] == [1, 2, 3]
    assert len(result["token_ids"]) == 7
    assert all(isinstance(t, int) and 0 <= t < 512 for t in result["token_ids"])
    assert result["finish_reason"] == "length"
    assert isinstance(result["text"], str)
    assert result["text"] == Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json")).decode(
        result["token_ids"], skip_special_tokens=True)
    assert result["logprobs"] is None
    assert result["device"] == "cpu"


def test_generate_device_line_on_stderr_says_cpu(capsys, tiny_checkpoint):
    code, out, err = run(capsys, "generate", "--model-path", tiny_checkpoint, "--prompt-ids", PROMPT,
                         "--max-tokens", "2", "--ignore-eos")
    assert code == 0
    lines = err.strip().splitlines()
    assert lines[0].startswith("pegainfer: device cpu (")
    assert "2 tokens on cpu" in lines[-1] and "finish_reason=length" in lines[-1]
    assert len(out.strip().splitlines()) == 1  # the text only


def test_generate_device_cpu_explicit(capsys, tiny_checkpoint):
    code, _, err = run(capsys, "generate", "--model-path", tiny_checkpoint, "--prompt-ids", PROMPT,
                       "--max-tokens", "1", "--device", "cpu")
    assert code == 0 and "pegainfer: device cpu (asked for)" in err


def test_greedy_is_deterministic_and_equals_top_k_1(capsys, tiny_checkpoint):
    args = ("--prompt-ids", "5,9,200,17", "--max-tokens", "8", "--ignore-eos")
    first = generate(capsys, tiny_checkpoint, *args)
    second = generate(capsys, tiny_checkpoint, *args)
    assert first["token_ids"] == second["token_ids"]
    top1 = generate(capsys, tiny_checkpoint, *args, "--temperature", "1.0", "--top-k", "1", "--seed", "4")
    assert top1["token_ids"] == first["token_ids"]


def test_sampling_same_seed_same_tokens_different_seeds_differ(capsys, tiny_checkpoint):
    args = ("--prompt-ids", PROMPT, "--max-tokens", "8", "--ignore-eos", "--temperature", "1.0")
    runs = {seed: generate(capsys, tiny_checkpoint, *args, "--seed", str(seed))["token_ids"] for seed in range(4)}
    assert generate(capsys, tiny_checkpoint, *args, "--seed", "0")["token_ids"] == runs[0]
    assert any(runs[seed] != runs[0] for seed in (1, 2, 3)), runs


def test_text_prompt_uses_the_tokenizer(capsys, tiny_checkpoint):
    text = "The quick brown fox jumps over the lazy dog."
    result = generate(capsys, tiny_checkpoint, "--prompt", text, "--max-tokens", "3", "--ignore-eos")
    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    expected = tokenizer.encode(text).ids
    assert len(expected) > 1
    assert result["prompt_token_ids"] == expected
    via_ids = generate(capsys, tiny_checkpoint, "--prompt-ids", ",".join(map(str, expected)), "--max-tokens", "3",
                       "--ignore-eos")
    assert via_ids["token_ids"] == result["token_ids"]


def test_logprobs(capsys, tiny_checkpoint):
    result = generate(capsys, tiny_checkpoint, "--prompt-ids", PROMPT, "--max-tokens", "6", "--ignore-eos",
                      "--logprobs", "3")
    assert len(result["logprobs"]) == len(result["token_ids"]) == 6
    for token, step in zip(result["token_ids"], result["logprobs"]):
        assert len(step) >= 3
        assert str(token) in step
        assert all(value <= 0 for value in step.values())
        assert step[str(token)] == max(step.values())  # greedy: the chosen token is the most likely
        assert sum(np.exp(v) for v in step.values()) <= 1 + 1e-9


def test_logprobs_when_sampling_contain_the_sampled_token(capsys, tiny_checkpoint):
    result = generate(capsys, tiny_checkpoint, "--prompt-ids", PROMPT, "--max-tokens", "8", "--ignore-eos",
                      "--logprobs", "1", "--temperature", "1.5", "--seed", "0")
    for token, step in zip(result["token_ids"], result["logprobs"]):
        assert str(token) in step and 1 <= len(step) <= 2
        assert all(value <= 0 for value in step.values())


def test_eos_stops_unless_ignored(capsys, tiny_checkpoint, tmp_path):
    greedy = generate(capsys, tiny_checkpoint, "--prompt-ids", PROMPT, "--max-tokens", "4", "--ignore-eos")
    folder = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    eos = greedy["token_ids"][1]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    stopped = generate(capsys, folder, "--prompt-ids", PROMPT, "--max-tokens", "4")
    assert stopped["finish_reason"] == "stop"
    first_eos = greedy["token_ids"].index(eos)
    assert stopped["token_ids"] == greedy["token_ids"][: first_eos + 1]
    ignored = generate(capsys, folder, "--prompt-ids", PROMPT, "--max-tokens", "4", "--ignore-eos")
    assert ignored["token_ids"] == greedy["token_ids"] and ignored["finish_reason"] == "length"


def test_max_position_embeddings_caps_the_completion(capsys, tiny_checkpoint, tmp_path):
    folder = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 8
    (folder / "config.json").write_text(json.dumps(config))
    result = generate(capsys, folder, "--prompt-ids", "1,2,3,4,5", "--max-tokens", "10", "--ignore-eos")
    assert len(result["token_ids"]) == 3 and result["finish_reason"] == "length"
    code, _, err = run(capsys, "generate", "--model-path", folder, "--prompt-ids", "1,2,3,4,5,6,7,8")
    assert code == 1 and "max_position_embeddings" in one_line_error(err)


def test_prompt_ids_without_tokenizer_prints_ids(capsys, tiny_checkpoint, tmp_path):
    folder = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    (folder / "tokenizer.json").unlink()
    result = generate(capsys, folder, "--prompt-ids", PROMPT, "--max-tokens", "3", "--ignore-eos")
    assert result["text"] is None and len(result["token_ids"]) == 3
    code, out, _ = run(capsys, "generate", "--model-path", folder, "--prompt-ids", PROMPT, "--max-tokens", "3",
                       "--ignore-eos")
    assert code == 0 and out.split() == [str(t) for t in result["token_ids"]]
    code, _, err = run(capsys, "generate", "--model-path", folder, "--prompt", "hello")
    assert code == 1 and "tokenizer.json" in one_line_error(err)


# --- generate: bad inputs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["--prompt-ids", "1,600"], ["600", "prompt"]),
    (["--prompt-ids", "1,-1"], ["-1", "prompt"]),
    (["--prompt-ids", ","], ["prompt", "empty"]),
    (["--prompt-ids", PROMPT, "--top-p", "0"], ["top_p"]),
    (["--prompt-ids", PROMPT, "--top-p", "1.5"], ["top_p"]),
    (["--prompt-ids", PROMPT, "--temperature", "-1"], ["temperature"]),
    (["--prompt-ids", PROMPT, "--max-tokens", "0"], ["max_tokens"]),
    (["--prompt-ids", PROMPT, "--logprobs", "50"], ["logprobs", "50"]),
    (["--prompt-ids", PROMPT, "--top-k", "-5"], ["top_k"]),
    (["--prompt-ids", PROMPT, "--device", "cuda"], ["--device", "cuda"]),
], ids=["id_too_large", "id_negative", "empty", "top_p_0", "top_p_1.5", "temperature", "max_tokens", "logprobs",
        "top_k", "device_cuda"])
def test_generate_bad_inputs(capsys, tiny_checkpoint, args, words):
    code, out, err = run(capsys, "generate", "--model-path", tiny_checkpoint, *args)
    assert code == 1 and out == ""
    line = one_line_error(err)
    for word in words:
        assert word.replace("_", "-") in line or word in line, line


def test_generate_nonexistent_model_path(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    code, _, err = run(capsys, "generate", "--model-path", missing, "--prompt-ids", PROMPT)
    assert code == 1 and str(missing) in one_line_error(err)


def test_generate_corrupt_checkpoint_is_a_one_line_error(capsys, tiny_checkpoint, tmp_path):
    folder = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    (folder / "config.json").write_text("{")
    code, _, err = run(capsys, "generate", "--model-path", folder, "--prompt-ids", PROMPT)
    assert code == 1 and "config.json" in one_line_error(err)


@pytest.mark.parametrize("args,option", [
    (["--prompt-ids", "1,a"], "--prompt-ids"),
    (["--prompt-ids", PROMPT, "--max-tokens", "many"], "--max-tokens"),
    (["--prompt-ids", PROMPT, "--device", "tpu"], "--device"),
    (["--prompt-ids", PROMPT, "--prompt", "hi"], "--prompt"),
])
def test_generate_argparse_errors(capsys, tiny_checkpoint, args, option):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model-path", str(tiny_checkpoint), *args])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: argument" in last and option in last, last


def test_generate_negative_seed(capsys, tiny_checkpoint):
    code, _, err = run(capsys, "generate", "--model-path", tiny_checkpoint, "--prompt-ids", PROMPT,
                       "--temperature", "1", "--seed", "-1", "--max-tokens", "2")
    assert code == 0 or (code == 1 and "seed" in one_line_error(err))


# --- inspect ----------------------------------------------------------------------------------------------------

def test_inspect_text(capsys):
    code, out, _ = run(capsys, "inspect", "qwen3-4b", "--show", "graph")
    assert code == 0
    assert "repeat" in out and "count=36" in out
    assert "graph qwen3_layer" in out and "graph qwen3(" in out


def test_inspect_dot(capsys):
    code, out, _ = run(capsys, "inspect", "Qwen3-4B", "--show", "graph", "--format", "dot")
    assert code == 0 and out.startswith("digraph") and out.rstrip().endswith("}")


def test_inspect_checkpoint_folder(capsys, tiny_checkpoint):
    code, out, _ = run(capsys, "inspect", tiny_checkpoint, "--show", "graph")
    assert code == 0 and "count=2" in out


def test_inspect_unknown_model(capsys):
    code, out, err = run(capsys, "inspect", "qwen9-1t")
    assert code == 1 and out == ""
    line = one_line_error(err)
    assert "qwen9-1t" in line and "qwen3-4b" in line


# --- make-checkpoint --------------------------------------------------------------------------------------------

def test_make_checkpoint_with_override(capsys, tmp_path):
    out_dir = tmp_path / "one_layer"
    code, _, err = run(capsys, "make-checkpoint", out_dir, "--set", "num_hidden_layers=1")
    assert code == 0 and str(out_dir) in err
    model = load_model(out_dir)
    assert model.spec.config.num_hidden_layers == 1
    assert any(name.startswith("model.layers.0.") for name in model.weights)
    assert not any(name.startswith("model.layers.1.") for name in model.weights)
    assert (out_dir / "tokenizer.json").is_file()


def test_make_checkpoint_word_tokenizer_streams_every_token_as_text(capsys, tmp_path):
    """--tokenizer words: each id past the special tokens is a word, so a random model's every token is text."""
    from pegainfer.runtime.detokenize import IncrementalDetokenizer
    from pegainfer.runtime.tokenizer import load_tokenizer

    out_dir = tmp_path / "words"
    code, _, _ = run(capsys, "make-checkpoint", out_dir, "--set", "num_hidden_layers=1", "--tokenizer", "words")
    assert code == 0
    vocab = load_model(out_dir).spec.config.vocab_size
    tokenizer = load_tokenizer(out_dir)
    ids = np.random.default_rng(0).integers(3, vocab, 50).tolist()
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert all(detokenizer.add(token) for token in ids)  # nothing held back
    assert tokenizer.encode(tokenizer.decode(ids)) == ids
    assert tokenizer.encode("<|im_start|>w5 w6<|im_end|>") == [1, 5, 6, 2]


def test_make_checkpoint_rejects_a_small_vocabulary(capsys, tmp_path):
    code, _, err = run(capsys, "make-checkpoint", tmp_path / "x", "--set", "vocab_size=100")
    assert code == 1 and "vocab_size" in one_line_error(err)


def test_make_checkpoint_bad_override_syntax(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["make-checkpoint", str(tmp_path / "x"), "--set", "num_hidden_layers"])
    assert exit_.value.code == 2 and "--set" in capsys.readouterr().err


# --- the installed command --------------------------------------------------------------------------------------

def test_console_script_matches_in_process(capsys, tiny_checkpoint, tmp_path):
    args = ["generate", "--model-path", str(tiny_checkpoint), "--prompt-ids", PROMPT, "--max-tokens", "5",
            "--ignore-eos", "--json"]
    script = Path(sys.executable).with_name("pegainfer")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "pegainfer.cli"]
    done = subprocess.run([*command, *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pegainfer: device cpu" in done.stderr
    assert json.loads(done.stdout)["token_ids"] == generate(capsys, tiny_checkpoint, *args[3:-1])["token_ids"]
    bad = subprocess.run([*command, *args, "--top-p", "0"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert bad.returncode == 1 and one_line_error(bad.stderr) and "top_p" in bad.stderr


def test_inspect_dag_as_svg_renders_or_says_what_is_missing(capsys):
    import shutil
    code, out, err = run(capsys, "inspect", "qwen3-0.6b", "--show", "dag", "--format", "svg")
    if shutil.which("dot"):
        assert code == 0 and "<svg" in out and "add_rms_norm_linear" in out
    else:
        assert code == 1 and "needs Graphviz's `dot` on the PATH" in one_line_error(err)


# --- bad input anywhere: one line, exit 2 for usage errors and 1 for the rest -----------------------------------

def usage_error(capsys, *args: str) -> str:
    """argparse's way: a usage line, then one `error:` line, exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "Traceback" not in err and [line for line in err.splitlines() if "error:" in line] == \
        [err.strip().splitlines()[-1]], err
    return err.strip().splitlines()[-1]


def copy_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


@pytest.mark.parametrize("content,words", [
    ("[1, 2]", ["expected a JSON object", "list"]),
    ('"x"', ["expected a JSON object", "str"]),
    ("{", ["not valid JSON"]),
    ('{"eos_token_id": "a"}', ["eos_token_id", '"a"']),
    ('{"eos_token_id": [[1]]}', ["eos_token_id", "[[1]]"]),
    ('{"eos_token_id": [2, 1.5]}', ["eos_token_id", "1.5"]),
    ('{"eos_token_id": true}', ["eos_token_id", "true"]),
    ('{"eos_token_id": -3}', ["eos_token_id", "-3"]),
], ids=["list", "string", "truncated", "eos_string", "eos_nested", "eos_float", "eos_bool", "eos_negative"])
def test_bad_generation_config_is_one_line_naming_the_file(capsys, tiny_checkpoint, tmp_path, content, words):
    folder = copy_checkpoint(tiny_checkpoint, tmp_path)
    (folder / "generation_config.json").write_text(content)
    for prompt in (["--prompt-ids", PROMPT], ["--prompt", "hello"]):  # the ids alone, and through the tokenizer
        code, out, err = run(capsys, "generate", "--model-path", folder, *prompt, "--max-tokens", "2")
        line = one_line_error(err)
        assert code == 1 and out == "" and str(folder / "generation_config.json") in line, line
        assert all(word in line for word in words), line


def test_config_eos_token_id_is_checked_when_generation_config_has_none(capsys, tiny_checkpoint, tmp_path):
    folder = copy_checkpoint(tiny_checkpoint, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": {"id": 2}}))
    code, _, err = run(capsys, "generate", "--model-path", folder, "--prompt-ids", PROMPT, "--max-tokens", "2")
    line = one_line_error(err)
    assert code == 1 and str(folder / "config.json") in line and "eos_token_id" in line, line


def test_eos_token_ids_take_an_id_or_a_list_and_fall_back_to_config(tmp_path):
    from pegainfer.runtime.tokenizer import eos_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tmp_path) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert eos_token_ids(tmp_path) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 5]}))
    assert eos_token_ids(tmp_path) == {3, 5}


@pytest.mark.parametrize("setting,words", [
    ("num_hidden_layers=abc", ["num_hidden_layers", "must be an int", "'abc'"]),
    ("hidden_size=-4", ["hidden_size", "at least 1", "-4"]),
    ("hidden_size=1.5", ["hidden_size", "must be an int"]),
    ("vocab_size=abc", ["vocab_size", "must be an int"]),
    ("num_attention_heads=3", ["num_attention_heads 3", "multiple of num_key_value_heads 2"]),
    ("head_dim=null", ["transformers cannot build it", "head_dim"]),
    ("architectures=[\"LlamaForCausalLM\"]", ["architectures", "--arch"]),
    ("eos_token_id=5", ["eos_token_id", "tokenizer"]),
    ("torch_dtype=int8", ["torch_dtype", "--dtype"]),
], ids=["not_int", "negative", "float", "vocab_not_int", "heads", "transformers", "architectures", "eos", "dtype"])
def test_make_checkpoint_bad_overrides_are_one_line(capsys, tmp_path, setting, words):
    out_dir = tmp_path / "x"
    code, _, err = run(capsys, "make-checkpoint", out_dir, "--set", setting)
    line = one_line_error(err)
    assert code == 1 and all(word in line for word in words), line
    assert not out_dir.exists()  # judged before anything is written


def test_make_checkpoint_into_a_file_or_below_one(capsys, tmp_path):
    target = tmp_path / "a_file"
    target.write_text("not a folder")
    code, _, err = run(capsys, "make-checkpoint", target)
    assert code == 1 and f"{target}: exists and is not a folder" in one_line_error(err)
    code, _, err = run(capsys, "make-checkpoint", target / "sub")
    assert code == 1 and f"{target / 'sub'}: cannot create the folder (Not a directory)" in one_line_error(err)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any folder")
def test_make_checkpoint_into_an_unwritable_folder(capsys, tmp_path):
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    code, _, err = run(capsys, "make-checkpoint", folder)
    assert code == 1 and f"{folder}: the folder is not writable" in one_line_error(err)


@pytest.mark.parametrize("args,option", [
    (["--logit-std", "0"], "--logit-std"),
    (["--logit-std", "-2"], "--logit-std"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2 ** 64)], "--seed"),
])
def test_make_checkpoint_bad_flag_values_are_usage_errors(capsys, tmp_path, args, option):
    line = usage_error(capsys, "make-checkpoint", tmp_path / "x", *args)
    assert f"argument {option}" in line and args[1] in line, line
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args,option", [
    (["compile", "qwen3-0.6b", "--sm", "90", "--jobs", "0"], "--jobs"),
    (["compile", "qwen3-0.6b", "--sm", "90", "--jobs", "-3"], "--jobs"),
    (["tune", "qwen3-0.6b", "--jobs", "0"], "--jobs"),
    (["bench", "decode", "qwen3-0.6b", "--steps", "0"], "--steps"),
    (["bench", "decode", "qwen3-0.6b", "--pdl-max-tokens", "-1"], "--pdl-max-tokens"),
    (["bench", "decode", "qwen3-0.6b", "--batch", "0"], "--batch"),
])
def test_counts_below_their_minimum_are_usage_errors(capsys, args, option):
    line = usage_error(capsys, *args)
    assert f"argument {option}" in line and args[-1] in line, line


@pytest.mark.parametrize("args,words", [
    (["--sm", "abc"], ["--sm abc", "80,90"]),
    (["--sm", "0"], ["--sm 0", "supported are"]),
    (["--sm", "90", "--backends", "nope"], ["--backends nope", "triton"]),
    (["--sm", "90", "--dump-after", "nope"], ["--dump-after nope", "fuse_add_rms_norm"]),
    (["--sm", "90", "--dump-dir", "dumps"], ["--dump-dir", "--dump-after"]),
], ids=["sm_text", "sm_0", "backends", "dump_after", "dump_dir_alone"])
def test_compile_bad_flag_values_are_usage_errors(capsys, tmp_path, args, words):
    line = usage_error(capsys, "compile", "qwen3-0.6b", "--cache-dir", tmp_path / "cache", *args)
    assert all(word in line for word in words), line
    assert not (tmp_path / "cache").exists()  # refused before compiling anything


def test_compile_into_a_cache_or_dump_folder_that_is_a_file(capsys, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    code, _, err = run(capsys, "compile", "qwen3-0.6b", "--sm", "90", "--cache-dir", a_file)
    assert code == 1 and f"cubin cache {a_file}: exists and is not a folder" in one_line_error(err)
    code, _, err = run(capsys, "compile", "qwen3-0.6b", "--sm", "90", "--cache-dir", a_file / "sub")
    assert code == 1 and f"cubin cache {a_file / 'sub'}: cannot create it" in one_line_error(err)
    code, _, err = run(capsys, "compile", "qwen3-0.6b", "--sm", "90", "--cache-dir", tmp_path / "cache",
                       "--dump-after", "all", "--dump-dir", a_file)
    assert code == 1 and f"--dump-dir {a_file}: exists and is not a folder" in one_line_error(err)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("args,words", [
    (["--show", "kernels", "--format", "svg"], ["--format svg", "graph and dag", "not to --show kernels"]),
    (["--show", "sass", "--sm", "90", "--format", "dot"], ["--format dot", "graph and dag", "not to --show sass"]),
    (["--show", "graph", "--json"], ["--json", "--show kernels without --sm", "not to --show graph"]),
    (["--show", "kernels", "--sm", "90", "--json"], ["--json", "without --sm"]),
    (["--show", "dag", "--sm", "90"], ["--sm", "not to --show dag"]),
    (["--show", "kernels", "--kernel", "down"], ["--kernel", "source, ptx, sass, resources"]),
    (["--show", "passes", "--cache-dir", "x"], ["--cache-dir", "--sm"]),
    (["--show", "ptx"], ["--show ptx needs --sm"]),
    (["--show", "kernels", "--sm", "0"], ["--sm 0", "supported are"]),
], ids=["format_kernels", "format_sass", "json_graph", "json_sm", "sm_dag", "kernel", "cache_dir", "no_sm", "sm_0"])
def test_inspect_flags_that_do_not_apply_are_usage_errors(capsys, args, words):
    line = usage_error(capsys, "inspect", "qwen3-0.6b", *args)
    assert all(word in line for word in words), line


@pytest.mark.parametrize("args,words", [
    (["prefill", "qwen3-0.6b", "--batch", "4"], ["--batch", "bench decode", "not to bench prefill"]),
    (["decode", "qwen3-0.6b", "--prompt-len", "64"], ["--prompt-len", "bench prefill", "not to bench decode"]),
    (["serve", "--cache-dir", "x"], ["--cache-dir", "not to bench serve"]),
    (["serve", "--steps", "3"], ["--steps", "not to bench serve"]),
])
def test_bench_flags_of_another_mode_are_usage_errors(capsys, args, words):
    line = usage_error(capsys, "bench", *args)
    assert all(word in line for word in words), line


def test_inspect_a_folder_without_config_or_a_config_that_is_not_an_object(capsys, tmp_path):
    code, _, err = run(capsys, "inspect", tmp_path, "--show", "graph")
    assert code == 1 and f"{tmp_path / 'config.json'}: no such file" in one_line_error(err)
    listed = tmp_path / "listed.json"
    listed.write_text("[1, 2]")
    code, _, err = run(capsys, "inspect", listed, "--show", "graph")
    assert code == 1 and f"{listed}: expected a JSON object, found list" in one_line_error(err)


def parser_options(parser, path: str = "pegainfer"):
    """(command, option) of every argument of every subcommand, positional ones included."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parser_options(sub, f"{path} {name}")
        else:
            yield path, action


def test_every_option_of_every_command_has_help():
    from pegainfer.cli import build_parser

    options = list(parser_options(build_parser()))
    assert {path for path, _ in options} >= {f"pegainfer {c}" for c in (
        "generate", "serve", "make-checkpoint", "inspect", "compile", "bench", "tune")}
    missing = [f"{path} {'/'.join(action.option_strings) or action.dest}" for path, action in options
               if not action.help]
    assert not missing, f"options without help: {', '.join(missing)}"


def test_version_is_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"pegainfer {version('pegainfer')}\n"


@pytest.fixture(scope="module")
def compiled_tiny(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny checkpoint compiled for sm_90 (every installed backend, as inspect compiles): (cache, manifest)."""
    cache = tmp_path_factory.mktemp("cli_cache")
    assert main(["compile", str(tiny_checkpoint), "--sm", "90", "--jobs", "2", "--cache-dir", str(cache)]) == 0
    (manifest,) = (cache / "sm_90" / "manifests").iterdir()
    return cache, manifest


@pytest.mark.slow
def test_inspect_rebuilds_a_corrupt_manifest_as_compile_does(capsys, tiny_checkpoint, compiled_tiny):
    cache, manifest = compiled_tiny
    args = ("inspect", tiny_checkpoint, "--sm", "90", "--show", "kernels", "--cache-dir", cache)
    code, intact, _ = run(capsys, *args)
    assert code == 0 and "sm_90: backends" in intact
    good = manifest.read_bytes()
    for corrupt in (good[: len(good) // 3], b"[]", b""):
        manifest.write_bytes(corrupt)
        code, out, err = run(capsys, *args)
        assert code == 0 and err == "" and out == intact
        assert manifest.read_bytes() == good  # rewritten whole, from the cached cubins


@pytest.mark.slow
@pytest.mark.parametrize("show", ["resources", "source", "ptx", "sass"])
def test_inspect_compiled_kernels_over_a_truncated_manifest(capsys, tiny_checkpoint, compiled_tiny, show):
    cache, manifest = compiled_tiny
    args = ("inspect", tiny_checkpoint, "--sm", "90", "--show", show, "--kernel", "embedding", "--cache-dir", cache)
    code, intact, _ = run(capsys, *args)
    assert code == 0 and intact
    good = manifest.read_bytes()
    manifest.write_bytes(good[:100])
    code, out, err = run(capsys, *args)
    assert code == 0 and err == "" and out == intact and manifest.read_bytes() == good


@pytest.mark.slow
def test_inspect_a_cache_entry_missing_a_file_is_one_line(capsys, tiny_checkpoint, compiled_tiny, tmp_path):
    cache, manifest = compiled_tiny
    copy = Path(shutil.copytree(cache, tmp_path / "cache"))
    kernel = json.loads(manifest.read_text())["kernels"][0]
    key = kernel["variants"][0]["launches"][0]["key"]
    for suffix, show in (("ptx", "ptx"), ("cubin", "sass"), ("json", "resources")):
        (copy / "sm_90" / f"{key}.{suffix}").unlink()
        code, _, err = run(capsys, "inspect", tiny_checkpoint, "--sm", "90", "--show", show, "--kernel",
                           kernel["node"], "--cache-dir", copy)
        line = one_line_error(err)
        assert code == 1 and f"{key}.{suffix}" in line and "pegainfer compile" in line, line
