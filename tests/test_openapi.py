"""/openapi.json is true: schemathesis sends requests made from the document itself (valid bodies and broken
ones) to a live server and checks that none gets a 5xx, and that every answer's status, media type and body are
the ones the document gives for that route."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from live_server import start_server, stop_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 25  # per operation and mode: bounded, so the suite stays short


@pytest.fixture(scope="module")
def api(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("openapi") / "serve.log"
    # a short context and few sequences a request keep each generated completion to a few engine steps
    server = start_server(tiny_checkpoint, "--max-seqs-per-request", "4", "--max-model-len", "48", log=log)
    yield schemathesis.openapi.from_url(server.url + "/openapi.json")
    stop_server(server)


def operations(api) -> dict[str, object]:
    return {operation.label: operation for operation in (result.ok() for result in api.get_all_operations())}


def test_the_document_lists_every_route(api):
    assert set(operations(api)) == {
        "GET /health", "GET /metrics", "GET /version", "GET /v1/models", "GET /v1/models/{model_id}",
        "POST /tokenize", "POST /detokenize", "GET /tokenizer_info", "POST /v1/completions",
        "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages", "POST /v1/messages/count_tokens",
        "POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_matches_the_published_schema(api, mode):
    for label, operation in operations(api).items():
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # no body to break: any path string is a valid model id
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=60)
        try:
            check()
        except Exception as error:
            raise AssertionError(f"{label} ({mode}): {error}") from error


@pytest.mark.parametrize("label, body", [
    ("POST /v1/completions", {"prompt": "hello there", "max_tokens": 4, "stream": True}),
    ("POST /v1/completions", {"prompt": "hello there", "max_tokens": 2, "echo": True, "logprobs": 1}),
    ("POST /v1/completions", {"prompt": "hello there", "max_tokens": 2, "echo": True, "logprobs": 1,
                              "stream": True}),
    ("POST /v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                                   "stream_options": {"include_usage": True}}),
    ("POST /v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True}),
    ("POST /v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})])
def test_answers_the_examples_seldom_ask_for_match_the_document(api, label, body):
    """The examples above rarely ask for a stream or an echo with logprobs (whose first entries are null): those
    answers, and each server-sent event, are checked against the document here."""
    operations(api)[label].Case(body=body, media_type="application/json").call_and_validate(checks=CHECKS,
                                                                                            timeout=60)
