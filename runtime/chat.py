"""The checkpoint's chat template (tokenizer_config.json's `chat_template`, or chat_template.jinja beside it),
rendered with jinja2 in a sandbox as transformers renders it."""

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pegainfer.errors import CheckpointError, RequestError


@dataclass
class ChatTemplate:
    source: str
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template may use them

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise, strftime_now=lambda f: datetime.now().strftime(f))
        try:
            template = environment.from_string(self.source)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **kwargs})
        except RequestError:
            raise
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError) as error:  # the messages' shape
            raise RequestError(f"the chat template could not render these messages: {error}") from None


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """None when the checkpoint has no chat template (chat completions are then refused)."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        source = named.get("default")
    if source is None and (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    if source is None:
        return None
    if not isinstance(source, str):
        raise CheckpointError(f"{config_path}: chat_template must be a string, found {type(source).__name__}")
    tokens = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return ChatTemplate(source, {k: v for k, v in tokens.items() if v is not None})


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _raise(message: str) -> None:
    raise RequestError(f"the chat template refused these messages: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)
