"""lm-eval 0.4's `local-completions` against a live `serve --device cpu`: a multiple-choice task from a local JSONL
file runs end to end (loglikelihood requests: echo, logprobs, max_tokens 0), and every choice's loglikelihood is the
sum of the CPU engine's prompt logprobs over the choice's tokens."""

import json
import os

import numpy as np
import pytest
import transformers

from live_server import NAME, start_server, stop_server
from pegainfer.frontends.load import load_model
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.reference_engine import ReferenceEngine

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file; nothing is fetched
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

DOCS = [{"question": "w5 w17 w33", "choices": ["w2", "w90 w41", "w7"], "answer": 1},
        {"question": "w12 w3 w150 w9", "choices": ["w66 w12", "w40"], "answer": 0},
        {"question": "w8", "choices": ["w21", "w22", "w23 w24 w25"], "answer": 2}]
TASK = """task: tiny_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def words_checkpoint(checkpoint_factory):
    return checkpoint_factory("tiny_words", tokenizer="words")


@pytest.fixture(scope="module")
def server(words_checkpoint, tmp_path_factory):
    server = start_server(words_checkpoint, log=tmp_path_factory.mktemp("lm_eval") / "serve.log")
    yield server
    stop_server(server)


def engine_loglikelihood(engine: ReferenceEngine, tokenizer, context: str, continuation: str) -> float:
    """The continuation's tokens' logprobs after the context, summed, from one prefill of both on the CPU engine
    (lm-eval's split: the context's tokens, then what the whole adds)."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    first = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    seq = Sequence(0, whole)
    logits = engine.step([Chunk(seq, len(whole))], all_logits=True).astype(np.float64)
    engine.release(seq)
    logprobs = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    return float(sum(logprobs[i - 1, whole[i]] for i in range(first, len(whole))))


def test_a_multiple_choice_task_runs_and_scores_as_the_cpu_engine(server, words_checkpoint, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "tiny_choices.yaml").write_text(TASK.format(data=data))
    results = simple_evaluate(
        model="local-completions", tasks=["tiny_choices"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=f"model={NAME},base_url={server.url}/v1/completions,tokenizer={words_checkpoint},"
                   f"tokenizer_backend=huggingface,num_concurrent=2,max_retries=1",
        log_samples=True, batch_size=1)
    samples = results["samples"]["tiny_choices"]
    assert len(samples) == len(DOCS) and 0.0 <= results["results"]["tiny_choices"]["acc,none"] <= 1.0
    engine = ReferenceEngine(load_model(words_checkpoint))
    tokenizer = transformers.AutoTokenizer.from_pretrained(words_checkpoint)
    for sample in samples:
        for (context, continuation), (loglikelihood, _) in zip(sample["arguments"], sample["filtered_resps"]):
            expected = engine_loglikelihood(engine, tokenizer, context, continuation)
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-3), (context, continuation)
