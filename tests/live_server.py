"""A `pegainfer serve --device cpu` process on loopback for the server tests, and what they ask of it."""

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

KEY = "test-key"
NAME = "tiny"
MAX_MODEL_LEN = 512


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    checkpoint: Path
    log: Path

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def post(self, path: str, body, key: str | None = KEY, headers: dict[str, str] | None = None,
             **kwargs) -> httpx.Response:
        """`body` as JSON, or bytes sent as they are (declared application/json unless `headers` say otherwise)."""
        headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
        if not isinstance(body, dict | list):
            headers.setdefault("Content-Type", "application/json")
            return httpx.post(self.url + path, content=body, headers=headers, timeout=60, **kwargs)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kwargs)

    def events(self, path: str, body: dict, key: str | None = KEY) -> list[dict]:
        """A streamed answer's server-sent events, each data object in order; it ends with [DONE] and holds no
        error object."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.stream("POST", self.url + path, json={"model": NAME, "stream": True, **body}, headers=headers,
                          timeout=60) as reply:
            assert reply.status_code == 200, reply.read()
            lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert not any("error" in c for c in chunks), chunks
        return chunks

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                name, labels = series.split("{", 1)
                reason = labels.split('finished_reason="')[1].split('"')[0] if "finished_reason" in labels else None
                values[f"{name}:{reason}" if reason else name] = float(value)
        return values


QWEN3_TEMPLATE = Path(__file__).parent / "qwen3_chat_template.jinja"  # Qwen3's published one: tools, thinking


def with_chat_template(checkpoint: Path, template: str | None = None) -> Path:
    """The checkpoint with `template` (Qwen3's by default) as its tokenizer_config.json's chat template."""
    path = checkpoint / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | {"chat_template": template or QWEN3_TEMPLATE.read_text()}))
    return checkpoint


TOOLS_FLAGS = ("--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--reasoning-parser", "qwen3")


def start_tools_server(checkpoint: Path, log: Path, *extra: str) -> Server:
    """A server as agents use one: Qwen3's template, hermes tool calls, qwen3 reasoning."""
    return start_server(with_chat_template(checkpoint), *TOOLS_FLAGS, *extra, log=log)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(checkpoint: Path, *extra: str, log: Path) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "pegainfer.cli", "serve", "--model-path", str(checkpoint), "--device", "cpu",
               "--port", str(port), "--served-model-name", NAME, "--max-model-len", str(MAX_MODEL_LEN), *extra]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", process, checkpoint, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited: {log.read_text()}"
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"the server was not ready in 120 s: {log.read_text()}")


def stop_server(server: Server) -> None:
    """Ends the server, and checks that no request left a traceback in its log (a handler that crashed)."""
    server.process.terminate()
    server.process.wait(30)
    assert "Traceback" not in server.log.read_text(), server.log.read_text()
