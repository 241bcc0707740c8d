"""`kha serve`, safety round 6 (#58 items 2, 3 and 10, and a cosmetic one), each on the real server on 127.0.0.1.

- A checkpoint's template `{{ m['content'] * 150000000 }}` and one 12-character request took the server past 4 GB:
  renders now run in worker processes with an address-space cap (`--render-memory`), ended at their time limit.
- `generation_config.json` with `do_sample: true, temperature: 1e-45` gave a 500, and under continuous batching a
  dead batch for every client: such a file is refused when the server starts.
- A request with both Content-Length and Transfer-Encoding was read as chunked and the rest served as a second
  request on the same connection (request smuggling behind a proxy).
- `POST /v1/completions/` answered 307 after the guard had checked the body.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import psutil
import pytest
import requests

from kha_hf.serving.guard import ServeLimits
from tests.cli.test_bad_input import one_line_error
from tests.helpers import free_port
from tests.serving.servers import tiny_kha
from tests.serving.test_serve_round5 import ENDLESS, ENDLESS_TEMPLATE

pytest.importorskip("fastapi")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TIMEOUT = 6  # the server's --request-timeout
RENDER_MEMORY = 256 << 20
BOMB = "hello world!"  # 12 characters, as in the report
# nothing for NOTHING, the bomb for BOMB, round 5's endless loop for ENDLESS, the plain template otherwise
NOTHING = "render nothing"  # the template renders this request to no text at all (#70 item 9)
# a text Python holds within --render-memory whose tokenisation does not fit: tokenizers' Rust allocator aborts the
# worker (#70 item 17)
TOKENS_BOMB = "tokens bomb"
HOSTILE_TEMPLATE = (
    "{% if messages[0]['content'] != '"
    + NOTHING
    + "' %}{% if messages[0]['content'] == '"
    + BOMB
    + "' %}{{ messages[0]['content'] * 150000000 }}{% endif %}"
    + "{% if messages[0]['content'] == '"
    + TOKENS_BOMB
    + "' %}{{ 'a b ' * 12000000 }}{% endif %}"
    + ENDLESS_TEMPLATE
    + "{% endif %}"
)
CLOSE = {"connection": "close"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kha_hf.serving.server import start_server

    root = tmp_path_factory.mktemp("round6")
    tiny_kha(root / "kha", max_positions=4096, eos=False, chat_template=HOSTILE_TEMPLATE)
    port = free_port()
    limits = ServeLimits(max_new_tokens=64, request_timeout=TIMEOUT, render_memory=RENDER_MEMORY)
    running = start_server(str(root / "kha"), port=port, device="cpu", dtype="float32", limits=limits)
    yield f"http://127.0.0.1:{port}", running
    running.kill_server()


def chat(base: str, content: str, timeout: float = 120) -> requests.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    return requests.post(f"{base}{CHAT}", json=body, headers=CLOSE, timeout=timeout)


class PeakRSS:
    """The largest RSS of this process (the server runs in it) and, summed, of its children, sampled every 20 ms."""

    def __init__(self) -> None:
        self.me, self.children, self.stop = 0, 0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            self.me = max(self.me, me.memory_info().rss)
            total = 0
            for child in me.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:
                    pass
            self.children = max(self.children, total)
            time.sleep(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def test_a_templates_string_bomb_is_bounded_and_the_server_goes_on(server):
    base, _ = server
    assert chat(base, "the lazy dog").status_code == 200
    before = psutil.Process().memory_info().rss
    with PeakRSS() as peak:
        started = time.monotonic()
        response = chat(base, BOMB)
        seconds = time.monotonic() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "--render-memory (256 MiB)" in error["message"], error
    assert seconds < TIMEOUT
    # the server's own process did not grow by the 1.8 GB string; the workers stayed within their cap (2 of them,
    # each its own few hundred MB of code and the processor plus at most RENDER_MEMORY)
    assert peak.me - before < 150 << 20, (peak.me - before) >> 20
    assert peak.children < 2 * (900 << 20) + RENDER_MEMORY, peak.children >> 20
    for _ in range(3):  # the worker that ran out was replaced
        assert chat(base, "the lazy dog").status_code == 200


def test_a_request_the_template_renders_to_no_tokens_gets_a_400(server):
    base, _ = server
    response = chat(base, NOTHING)
    assert response.status_code == 400, response.text  # was a 500: "cannot reshape tensor of 0 elements"
    error = response.json()["error"]
    assert error["param"] == "messages" and "renders this request to no tokens" in error["message"], error
    assert chat(base, "the lazy dog").status_code == 200


def test_a_render_that_native_code_cannot_allocate_says_it_needed_more_render_memory(server):
    base, _ = server
    response = chat(base, TOKENS_BOMB)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # not "ended before it answered (out of memory, or killed)": the worker aborted inside tokenizers (SIGABRT)
    assert "needed more than --render-memory (256 MiB): native code ran out and aborted" in error["message"], error
    assert chat(base, "the lazy dog").status_code == 200


def test_an_endless_render_is_ended_with_its_worker(server):
    base, running = server
    started = time.monotonic()
    response = chat(base, ENDLESS)
    assert response.status_code == 408, response.text
    assert time.monotonic() - started < TIMEOUT + 5
    assert chat(base, "the lazy dog").status_code == 200
    assert requests.get(f"{base}/health", headers=CLOSE, timeout=30).status_code == 200
    workers = [c for c in psutil.Process().children(recursive=True) if c.name().startswith("python")]
    busy = [w for w in workers if w.cpu_percent(interval=0.5) > 50]
    assert not busy, "a render worker still runs the endless template"


def _raw(base: str, request: bytes) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(request)
        received = b""
        while True:
            try:
                chunk = conn.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    return received


def test_content_length_with_transfer_encoding_is_refused_and_nothing_is_smuggled(server):
    base, _ = server
    body = json.dumps({"prompt": "the", "max_tokens": 1, "temperature": 0}).encode()
    smuggled = b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    request = (
        (
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\ntransfer-encoding: chunked\r\n\r\n" % len(chunked)
        )
        + chunked
        + smuggled
    )
    answer = _raw(base, request)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # the smuggled GET got no answer: the connection closed
    # the same request with one framing header is served
    plain = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert _raw(base, plain).startswith(b"HTTP/1.1 200"), "one framing header"


def test_a_trailing_slash_is_served_not_redirected(server):
    base, _ = server
    body = {"prompt": "the", "max_tokens": 1, "temperature": 0}
    response = requests.post(f"{base}{COMPLETIONS}/", json=body, headers=CLOSE, timeout=60, allow_redirects=False)
    assert response.status_code == 200, (response.status_code, response.text)


def _render_workers() -> list[psutil.Process]:
    """The render workers: the children of this process's fork server (`render_pool`)."""
    servers = [c for c in psutil.Process().children() if "forkserver" in " ".join(c.cmdline())]
    return [worker for server in servers for worker in server.children()]


def test_a_worker_killed_while_idle_fails_no_request(server):
    base, _ = server
    assert chat(base, "the lazy dog").status_code == 200
    workers = _render_workers()
    assert len(workers) == 2, workers
    for worker in workers:
        worker.kill()
    psutil.wait_procs(workers, timeout=10)
    for _ in range(4):  # each request draws a dead worker first, then a fresh one
        response = chat(base, "the lazy dog")
        assert response.status_code == 200, response.text
    assert len(_render_workers()) == 2


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"do_sample": True, "temperature": 1e-45}, "temperature"),
        ({"do_sample": True, "typical_p": 0.0}, "typical_p"),
        ({"num_beams": 64}, "num_beams"),
        ({"do_sample": True, "epsilon_cutoff": 1.0}, "epsilon_cutoff"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"min_new_tokens": 1e8}, "min_new_tokens"),
        ({"do_sample": True, "temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": "1.1"}, "repetition_penalty"),
        ({"do_sample": True, "temperature": 10**400}, "temperature"),  # an OverflowError traceback once
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "penalty_alpha"),  # started, then every request was a 500
    ],
)
def test_sampling_settings_no_request_could_use_are_refused_at_start(tmp_path, capsys, settings, field):
    tiny_kha(tmp_path / "kha", max_positions=256)
    path = tmp_path / "kha" / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    err = one_line_error(capsys, ["serve", str(tmp_path / "kha"), "--port", str(free_port())], "serve")
    assert f"generation_config.json: {field} " in err and "outside what kha serve can generate with" in err, err


def test_sampling_settings_in_config_json_are_checked_without_a_generation_config(tmp_path, capsys):
    """Without generation_config.json, transformers builds the generation config from config.json."""
    tiny_kha(tmp_path / "kha", max_positions=256)
    (tmp_path / "kha" / "generation_config.json").unlink()
    path = tmp_path / "kha" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "do_sample": True, "temperature": 1e-45}))
    err = one_line_error(capsys, ["serve", str(tmp_path / "kha"), "--port", str(free_port())], "serve")
    assert "config.json: temperature 1e-45 is outside" in err, err


def test_an_unknown_cache_implementation_is_refused_at_start(tmp_path, capsys):
    """transformers 5.25 raised it from the engine's start, a 48-line traceback."""
    tiny_kha(tmp_path / "kha", max_positions=256)
    path = tmp_path / "kha" / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "cache_implementation": "bogus"}))
    err = one_line_error(capsys, ["serve", str(tmp_path / "kha"), "--port", str(free_port())], "serve")
    assert "generation_config.json: cache_implementation 'bogus' is not one of: static" in err, err


def test_suppressing_every_token_is_refused(tmp_path, capsys):
    tiny_kha(tmp_path / "kha", max_positions=256)
    path = tmp_path / "kha" / "generation_config.json"
    vocab = json.loads((tmp_path / "kha" / "config.json").read_text())["vocab_size"]
    path.write_text(json.dumps({**json.loads(path.read_text()), "suppress_tokens": list(range(vocab))}))
    err = one_line_error(capsys, ["serve", str(tmp_path / "kha"), "--port", str(free_port())], "serve")
    assert "nothing is left to say" in err, err


def test_a_render_memory_past_the_machine_is_refused(tmp_path, capsys):
    tiny_kha(tmp_path / "kha", max_positions=256)
    err = one_line_error(capsys, ["serve", str(tmp_path / "kha"), "--render-memory", str(10**13)], "serve")
    assert "--render-memory" in err and "more than this machine's memory" in err, err


def test_a_render_memory_of_zero_is_refused(tmp_path, capsys):
    tiny_kha(tmp_path / "kha", max_positions=256)
    err = one_line_error(capsys, ["serve", str(tmp_path / "kha"), "--render-memory", "0"], "serve")
    assert "--render-memory" in err, err
