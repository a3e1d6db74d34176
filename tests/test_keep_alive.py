"""Idle HTTP/1.1 connections: kept open past uvicorn's 5 s by default (a client that reads a response late and then
reuses its connection must not find it closing under its request), and closed after `--timeout-keep-alive`; a
request whose connection is closed under it is reported by `bench serve` with when it failed."""

import socket
import threading
import time

import pytest

from live_server import start_server, stop_server
from pegainfer.cli import main

OK = b"HTTP/1.1 200 OK"


def get_health(sock: socket.socket) -> bytes:
    """One keep-alive GET /health on an open connection; the response's status line, or b'' if it was closed."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return b""
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    length = int(next(line.split(b":")[1] for line in lines if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "the connection closed inside a response body"
        body += chunk
    return lines[0]


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def after_idle(sock: socket.socket, seconds: float) -> bytes:
    """The status line of a request sent after `seconds` idle, or b'' if the server closed the connection."""
    time.sleep(seconds)
    try:
        return get_health(sock)
    except ConnectionError:  # the server's close can come back as a reset of the write or the read
        return b""


@pytest.mark.slow
def test_an_idle_connection_outlives_uvicorns_five_seconds_by_default(tiny_checkpoint, tmp_path):
    server = start_server(tiny_checkpoint, log=tmp_path / "serve.log")
    try:
        with connect(server.url) as sock:
            assert get_health(sock) == OK
            assert after_idle(sock, 5.5) == OK
    finally:
        stop_server(server)


@pytest.mark.slow
def test_an_idle_connection_closes_after_the_keep_alive_given(tiny_checkpoint, tmp_path):
    server = start_server(tiny_checkpoint, "--timeout-keep-alive", "1", log=tmp_path / "serve.log")
    try:
        with connect(server.url) as sock:
            assert get_health(sock) == OK
            assert after_idle(sock, 0.3) == OK
            assert after_idle(sock, 2.0) == b""
    finally:
        stop_server(server)


def test_bench_serve_reports_a_connection_closed_under_its_request(capsys):
    """As a keep-alive close meets a request: the request arrives, is left unread, and the close resets it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def close_each() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                conn.recv(1, socket.MSG_PEEK)  # the request is in the buffer, unread

    thread = threading.Thread(target=close_each, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--input-len", "4",
                 "--output-len", "2", "--num-prompts", "2", "--max-concurrency", "1"])
    thread.join(10)
    listener.close()
    err = capsys.readouterr().err
    assert code == 1 and "2 requests failed" in err and "ReadError" in err and "s in, 0 chunks read" in err, err
