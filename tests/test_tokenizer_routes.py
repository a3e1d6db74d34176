"""/tokenize honours vLLM's add_special_tokens (default true for a prompt, false for messages, whose chat template
writes its own special tokens), and GET /tokenizer_info answers what vLLM's does and lm-eval's remote tokenizer
reads. The app is driven in this process (httpx's ASGI transport) over the reference engine of the tiny checkpoint,
with its tokenizer.json given a BOS post-processor (Llama's) where the test needs one."""

import asyncio
import shutil

import httpx
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, processors

from pegainfer.fixtures.checkpoint import CHAT_TEMPLATE
from pegainfer.runtime.tokenizer import TextTokenizer, load_tokenizer

KEY = "test-key"
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
RENDERED = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def bos_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint whose tokenizer puts <|endoftext|> before every sequence, as Llama's puts <s>."""
    folder = tmp_path_factory.mktemp("bos")
    for path in tiny_checkpoint.iterdir():
        shutil.copy(path, folder / path.name)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                             special_tokens=[("<|endoftext|>", bos)])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def app(bos_checkpoint):
    from pegainfer.frontends.load import load_model
    from pegainfer.runtime.chat import load_chat_template
    from pegainfer.runtime.engine_loop import EngineLoop
    from pegainfer.runtime.reference_engine import ReferenceEngine
    from pegainfer.runtime.scheduler import Scheduler
    from pegainfer.server.app import ServerContext, build_app
    from pegainfer.server.metrics import Metrics

    tokenizer = load_tokenizer(bos_checkpoint)
    model = load_model(bos_checkpoint)
    loop = EngineLoop(Scheduler(ReferenceEngine(model, max_tokens=MAX_MODEL_LEN), tokenizer.eos_token_ids)).start()
    ctx = ServerContext(loop, tokenizer, load_chat_template(bos_checkpoint), "tiny", str(bos_checkpoint),
                        MAX_MODEL_LEN, model.spec.config.vocab_size, Metrics("tiny"), api_key=KEY)
    yield build_app(ctx)
    loop.stop()


def call(app, method: str, path: str, body: dict | None = None, key: str | None = KEY) -> httpx.Response:
    async def send() -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pegainfer") as client:
            return await client.request(method, path, json=body, headers=headers)
    return asyncio.run(send())


def tokens(app, body: dict) -> list[int]:
    response = call(app, "POST", "/tokenize", body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["count"] == len(result["tokens"]) and result["max_model_len"] == MAX_MODEL_LEN
    return result["tokens"]


def test_a_prompt_gets_the_special_tokens_unless_asked_not_to(app, bos_checkpoint):
    tokenizer = Tokenizer.from_file(str(bos_checkpoint / "tokenizer.json"))
    bos = tokenizer.token_to_id("<|endoftext|>")
    plain = tokenizer.encode("naïve café", add_special_tokens=False).ids
    assert tokens(app, {"prompt": "naïve café"}) == [bos, *plain]
    assert tokens(app, {"prompt": "naïve café", "add_special_tokens": True}) == [bos, *plain]
    assert tokens(app, {"prompt": "naïve café", "add_special_tokens": False}) == plain
    # a special token written in the text is text, and stays
    assert tokens(app, {"prompt": "<|endoftext|>x", "add_special_tokens": False}) == [bos, *tokenizer.encode(
        "x", add_special_tokens=False).ids]


def test_messages_get_only_what_the_chat_template_writes_by_default(app, bos_checkpoint):
    tokenizer = Tokenizer.from_file(str(bos_checkpoint / "tokenizer.json"))
    rendered = tokenizer.encode(RENDERED, add_special_tokens=False).ids
    assert tokens(app, {"messages": MESSAGES}) == rendered
    assert tokens(app, {"messages": MESSAGES, "add_special_tokens": True}) == [tokenizer.token_to_id(
        "<|endoftext|>"), *rendered]


@pytest.mark.parametrize("value", ["yes", 1])  # null: the defaults
def test_add_special_tokens_must_be_a_boolean(app, value):
    response = call(app, "POST", "/tokenize", {"prompt": "x", "add_special_tokens": value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "add_special_tokens" and repr(value) in error["message"]


def test_tokenizer_info_has_what_vllm_and_lm_eval_read(app, bos_checkpoint):
    response = call(app, "GET", "/tokenizer_info")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    info = response.json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"], info["pad_token"], info["unk_token"]) == \
        (None, "<|im_end|>", "<|endoftext|>", None)
    assert info["model_max_length"] == MAX_MODEL_LEN and info["chat_template"] == CHAT_TEMPLATE
    # lm-eval's RemoteTokenizer: eos id through /tokenize without special tokens, the template rendered locally
    eos = Tokenizer.from_file(str(bos_checkpoint / "tokenizer.json")).token_to_id("<|im_end|>")
    assert tokens(app, {"prompt": info["eos_token"], "add_special_tokens": False}) == [eos]
    local = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(info["chat_template"])
    assert local.render(messages=MESSAGES, add_generation_prompt=True) == RENDERED
    assert call(app, "GET", "/tokenizer_info", key=None).status_code == 401  # behind the API key, as /tokenize


def test_tokenizer_info_takes_tokenizer_config_as_transformers_reads_it(tiny_checkpoint):
    tokenizer = load_tokenizer(tiny_checkpoint)
    config = {"tokenizer_class": "LlamaTokenizer", "vocab_file": "/models/x/tokenizer.model", "add_bos_token": True,
              "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
              "added_tokens_decoder": {"0": {"content": "<unk>", "special": True, "normalized": False}},
              "model_max_length": 1e30}
    info = TextTokenizer(tokenizer.tokenizer, frozenset({2}), config).info(None, 4096)
    assert info["tokenizer_class"] == "LlamaTokenizerFast" and "vocab_file" not in info
    assert info["bos_token"] == "<s>" and info["added_tokens_decoder"] == {"0": "<unk>"}
    assert info["eos_token"] == "<|im_end|>"  # not in the config: the token of generation_config's eos id
    assert info["add_bos_token"] is True and info["model_max_length"] == 4096 and info["chat_template"] is None


@pytest.mark.parametrize("template,before,after", [("<s> $A", 1, 0), ("$A </s>", 0, 1), ("<s> $A </s>", 1, 1),
                                                   (None, 0, 0)])
def test_without_added_specials_leaves_out_exactly_the_post_processor_tokens(tiny_checkpoint, template, before,
                                                                             after):
    tokenizer = load_tokenizer(tiny_checkpoint)
    inner = tokenizer.tokenizer
    inner.add_special_tokens(["<s>", "</s>"])
    if template is not None:
        inner.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[("<s>", inner.token_to_id("<s>")), ("</s>", inner.token_to_id("</s>"))])
    for text in ["hello world", "<s>x</s>", "日本"]:
        ids = tokenizer.encode(text)
        assert len(ids) == len(tokenizer.encode(text, add_special_tokens=False)) + before + after
        assert tokenizer.without_added_specials(ids) == tokenizer.encode(text, add_special_tokens=False)
