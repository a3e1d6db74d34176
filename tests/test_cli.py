"""The `pegainfer` command, mostly in-process through pegainfer.cli.main, once through the installed script."""

import json
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
