"""`kha serve` serves the model it was started with and nothing else, and no request can stall it.

Real servers on 127.0.0.1 (transformers' stack behind kha's guard), a tiny KHA model, requests by `requests`.
Every loop below is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from transformers import AutoTokenizer

from kha_hf import KHAForCausalLM
from kha_hf.serving.guard import RequestRegistry, ServeGuard, ServeLimits
from kha_hf.serving.server import start_server
from tests.helpers import free_port
from tests.serving.servers import tiny_kha

pytest.importorskip("fastapi")

LIMIT = 32  # the servers' --max-new-tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A running server for a tiny KHA model with a 256-token context, started as `kha serve ./kha` from its
    parent folder, with --trust-remote-code (which must still run no other folder's code)."""
    root = tmp_path_factory.mktemp("guard")
    tiny_kha(root / "kha", max_positions=256)
    port = free_port()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        server = start_server(
            "./kha",
            port=port,
            device="cpu",
            dtype="float32",
            trust_remote_code=True,
            limits=ServeLimits(max_new_tokens=LIMIT, request_timeout=60, max_request_bytes=64 * 1024),
        )
    finally:
        os.chdir(cwd)
    yield root, f"http://127.0.0.1:{port}", server
    server.kill_server()


def post(base: str, path: str, body, timeout: float = 120) -> requests.Response:
    return requests.post(f"{base}{path}", json=body, timeout=timeout)


def planted_remote_code_folder(folder, marker) -> None:
    """A checkpoint folder whose own code would write MARKER when imported."""
    folder.mkdir()
    code = f"open({str(marker)!r}, 'w').write(str(__import__('os').getpid()))\n"
    code += "from transformers import LlamaConfig\nclass EvilConfig(LlamaConfig):\n    model_type = 'evil'\n"
    (folder / "configuration_evil.py").write_text(code)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}})
    )


def test_load_model_and_reset_are_refused_and_run_no_code(served, tmp_path):
    root, base, _ = served
    marker = tmp_path / "ran"
    planted_remote_code_folder(tmp_path / "evil", marker)
    for path, body in (
        ("/load_model", {"model": str(tmp_path / "evil")}),
        ("/load_model", {"model": "../" * 8 + str(tmp_path / "evil")}),
        ("/reset", {}),
    ):
        response = post(base, path, body)
        assert response.status_code == 403, (path, response.text)
    for bad_path in ("/v1/systemone", "/v1/audio/transcriptions", "/docs", "/openapi.json"):
        assert post(base, bad_path, {}).status_code in (403, 404)
    response = post(base, "/v1/completions", {"model": str(tmp_path / "evil"), "prompt": "the", "max_tokens": 2})
    assert response.status_code == 404 and "not served here" in response.text
    assert not marker.exists(), "a client made the server run a folder's code"
    listed = requests.get(f"{base}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in listed] == [str(root / "kha")]
    assert post(base, "/v1/completions", {"prompt": "the", "max_tokens": 2}).status_code == 200  # still loaded


@pytest.mark.parametrize("name", ["./kha", "kha", "kha/", "KHA_ABS", None])
def test_the_model_may_be_named_as_typed_by_folder_name_or_absolute_path(served, name):
    root, base, _ = served
    body = {"prompt": "the quick", "max_tokens": 3, "temperature": 0}
    if name is not None:
        body["model"] = str(root / "kha") if name == "KHA_ABS" else name
    response = post(base, "/v1/completions", body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("name", ["other", "../kha", "/kha", "kha2", ""])
def test_other_model_names_are_not_found(served, name):
    _, base, _ = served
    response = post(base, "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 2})
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1e30}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": LIMIT + 1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "12"}, 400, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
            400,
            "max_completion_tokens",
        ),
        ("/v1/responses", {"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
        (
            "/v1/completions",
            {"prompt": "x", "generation_config": '{"max_new_tokens": 100000}'},
            400,
            "generation_config",
        ),
        ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
        ("/v1/completions", {"prompt": 12}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
        ("/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "messages[0].content[0].text",
        ),
        ("/v1/responses", {"input": 5}, 400, "input"),
        ("/v1/completions", {"prompt": "x", "model": 5}, 404, "model"),
    ],
)
def test_malformed_requests_get_4xx_not_500(served, path, body, status, param):
    _, base, _ = served
    response = post(base, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_bodies_that_are_not_json_objects_get_400(served):
    _, base, _ = served
    for content in (b"not json", b"[1, 2]", b"\xff\xfe"):
        headers = {"content-type": "application/json"}
        response = requests.post(f"{base}/v1/completions", data=content, headers=headers, timeout=30)
        assert response.status_code == 400, response.text


def test_prompts_are_capped_by_the_model_context_and_bodies_by_size(served):
    _, base, _ = served
    long_prompt = "the quick brown fox " * 200  # well over the 256-token context, under the byte limit
    response = post(base, "/v1/completions", {"prompt": long_prompt, "max_tokens": 4})
    assert response.status_code == 400 and "context is 256 tokens" in response.text
    chat = {"messages": [{"role": "user", "content": long_prompt}], "max_tokens": 4}
    assert post(base, "/v1/chat/completions", chat).status_code == 400
    huge = {"prompt": "x" * (1 << 20), "max_tokens": 4}  # 1 MB: over --max-request-bytes
    try:
        assert post(base, "/v1/completions", huge).status_code == 413
    except requests.ConnectionError:
        pass  # the server may answer 413 and close before the client has sent everything: refused either way


def test_without_max_tokens_generation_stops_at_the_server_limit(served):
    _, base, _ = served
    response = post(base, "/v1/completions", {"prompt": "the", "temperature": 0})
    assert response.status_code == 200
    usage = response.json()["usage"]
    assert usage["completion_tokens"] <= LIMIT


def _wait_until_idle(registry: RequestRegistry, seconds: float) -> float:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if registry.longest_running() == 0:
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"a generation still runs {seconds} s after its client disconnected")


@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory):
    """A model with a 65,536-token context and a 60,000-token limit: one generation would take minutes."""
    root = tmp_path_factory.mktemp("long")
    tiny_kha(root / "kha", max_positions=65536, eos=False)
    port = free_port()
    server = start_server(
        str(root / "kha"),
        port=port,
        device="cpu",
        dtype="float32",
        limits=ServeLimits(max_new_tokens=60000, request_timeout=600),
    )
    yield f"http://127.0.0.1:{port}", server
    server.kill_server()


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnected_client_stops_its_generation(long_context_server, stream):
    base, server = long_context_server
    registry = server.kha_registry
    body = {"prompt": "the", "max_tokens": 60000, "temperature": 0, "stream": stream}
    if stream:
        with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=(10, 30)) as response:
            chunks = response.iter_content(chunk_size=16)  # held: a dropped iterator closes the connection
            next(chunks)  # the first tokens; leaving the block closes the connection
            time.sleep(1)
            assert registry.longest_running() > 0
    else:
        # A client that sends its request, waits until the generation runs, and hangs up without reading an answer.
        # (Hanging up after a fixed read timeout raced the server: on a loaded machine the generation had not begun
        # 3 s later, or had already been stopped when the test looked.)
        payload = json.dumps(body).encode()
        host, port = base.removeprefix("http://").split(":")
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(head.encode() + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            deadline = time.monotonic() + 120
            while registry.longest_running() == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert registry.longest_running() > 0, "the generation never started"
    _wait_until_idle(registry, 15)  # the whole generation would take minutes
    quick = post(base, "/v1/completions", {"prompt": "the", "max_tokens": 2}, timeout=60)
    assert quick.status_code == 200


def _get(asgi_app, path: str, method: str = "GET") -> tuple[int, bytes]:
    """One GET (or METHOD) through an ASGI application, without a server."""
    import asyncio

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    asyncio.run(asgi_app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_health_reports_a_stuck_generation():
    async def app(scope, receive, send):  # transformers' app stands in: /health answers 200
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"status":"ok"}'})

    registry = RequestRegistry()
    guard = ServeGuard(app, "/m", {"/m"}, ServeLimits(request_timeout=5), registry)
    assert _get(guard, "/health")[0] == 200
    registry.running[1] = time.monotonic() - 40  # a generation started 40 s ago: past 5 s + 30 s of grace
    status, body = _get(guard, "/health")
    assert status == 503 and b"stuck" in body
    assert _get(guard, "/health", "HEAD") == (503, b"")
    del registry.running[1]
    assert _get(guard, "/health")[0] == 200


def test_head_on_health_and_models_answers_as_get_without_a_body(served):
    """Load balancers probe with HEAD; transformers' GET-only routes would answer 405."""
    _, base, _ = served
    for path in ("/health", "/v1/models"):
        got, head = requests.get(f"{base}{path}", timeout=30), requests.head(f"{base}{path}", timeout=30)
        assert got.status_code == 200 and got.content, path
        assert head.status_code == 200 and head.content == b"", (path, head.status_code, head.content[:200])
        assert head.headers.get("content-type") == got.headers.get("content-type")
    assert requests.head(f"{base}/v1/chat/completions", timeout=30).status_code == 405  # generation takes POST


def test_load_test_keeps_every_well_formed_request_answered(served):
    """50 requests, 8 at a time; 15 of them hostile. Every well-formed one gets 200 and the greedy text."""
    root, base, _ = served
    model = KHAForCausalLM.from_pretrained(root / "kha").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "kha")
    prompts = ["the quick", "over the lazy dog", "brown fox", "jumps over", "the lazy"]
    expected = {}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        expected[prompt] = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    hostile = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}),
        ("/v1/completions", {"prompt": "the " * 2000, "max_tokens": 4}),
        ("/load_model", {"model": "/etc"}),
        ("/v1/completions", {"model": "/etc", "prompt": "x"}),
        ("/v1/chat/completions", {"messages": "boom"}),
    ] * 3
    good = [("/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0}) for p in prompts] * 7
    requests = [(True, *g) for g in good] + [(False, *h) for h in hostile]
    requests = [requests[(i * 17) % 50] for i in range(50)]  # interleaved, deterministic

    def send(item):
        ok, path, body = item
        response = post(base, path, body, timeout=120)
        return ok, body, response

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(send, requests))
    assert time.monotonic() - start < 300
    assert sum(ok for ok, _, _ in results) == 35
    for ok, body, response in results:
        if ok:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected[body["prompt"]]
        else:
            assert 400 <= response.status_code < 500, response.text
