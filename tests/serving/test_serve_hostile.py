"""`kha serve` accepts only what it supports, stays live, and keeps every limit (issue #28, the server's part).

Two real servers on 127.0.0.1 for a tiny KHA model that never emits EOS (a generation runs until a limit stops
it): a sequential one and one with continuous batching, both with short time limits. Every loop below is
bounded in count and time; the time bounds are generous ("stops within N seconds").
"""

from __future__ import annotations

import json
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from transformers import AutoTokenizer

from kha_hf import KHAForCausalLM
from kha_hf.serving.fields import MAX_STOP_CHARS, MAX_STOP_STRINGS
from kha_hf.serving.guard import RequestRegistry, ServeGuard, ServeLimits
from kha_hf.serving.server import start_server
from tests.helpers import free_port
from tests.serving.servers import CHAT_TEMPLATE, tiny_kha

pytest.importorskip("fastapi")

LIMIT = 60000  # the sequential server's --max-new-tokens: a generation without max_tokens meets its time limit
TIMEOUT = 2  # both servers' --request-timeout
READ_TIMEOUT = 2  # the sequential server's --read-timeout
MAX_CONNECTIONS = 16
CB_BLOCKS = 8  # the continuous-batching server's paged cache: 2,048 tokens, less than the model's context
# the model's own template renders slowly (about 10 s on 2 cores) for one message only: a stand-in for any slow
# render, now that a client cannot send a template of its own
SLOW = "render slowly"
SLOW_TEMPLATE = (
    "{% if messages[0]['content'] == '" + SLOW + "' %}{% set ns = namespace(n=0) %}"
    "{% for i in range(1200) %}{% for j in range(1200) %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}"
    "{% endif %}" + CHAT_TEMPLATE
)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = [{"role": "user", "content": "the lazy dog"}]
# a request of each endpoint that gets 200; the fuzz changes one field at a time
BASE = {
    CHAT: {"messages": MESSAGES, "max_tokens": 2},
    COMPLETIONS: {"prompt": "the quick", "max_tokens": 2},
    RESPONSES: {"input": "the quick", "max_output_tokens": 2, "stream": False},
}
FIELDS = {
    CHAT: [
        "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stream",
        "frequency_penalty", "logit_bias", "stop", "tools", "n", "user", "chat_template_kwargs", "response_format",
    ],
    COMPLETIONS: [
        "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stream", "frequency_penalty", "stop",
        "suffix", "n", "user", "logit_bias", "echo", "best_of",
    ],
    RESPONSES: [
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "seed", "stream", "tools",
        "parallel_tool_calls", "user", "text", "reasoning",
    ],
}  # fmt: skip


def nested(levels: int):
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


WRONG = [
    None, True, False, 0, -1, 1, 2**64, -(2**63), 1e308, -1e-308, 1e-300, 0.5, -0.99999, "", "abc", "x" * 5000,
    "\ud800", [], [1, "a"], [None], {}, {"a": 1}, {"type": "text"}, {"role": "user"}, nested(40),
]  # fmt: skip
# fields inside the structured ones: (endpoint, the top-level field, body with a hole the fuzz fills)
USER = {"role": "user", "content": "x"}
CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
FUNCTION_CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}


def chat(*messages, **fields):
    return {"messages": list(messages), **fields}


def function(**fields):
    return {"type": "function", "function": {"name": "f", **fields}}


NESTED = [
    (CHAT, "messages", lambda v: chat({"role": v, "content": "x"})),
    (CHAT, "messages", lambda v: chat({"role": "user", "content": v})),
    (CHAT, "messages", lambda v: chat({"role": "user", "content": [v]})),
    (CHAT, "messages", lambda v: chat({"role": "user", "content": [{"type": "text", "text": v}]})),
    (CHAT, "messages", lambda v: chat(USER, {"role": "assistant", "tool_calls": v})),
    (CHAT, "messages", lambda v: chat(USER, {"role": "assistant", "tool_calls": [{**CALL, "id": v}]})),
    (CHAT, "messages", lambda v: chat(USER, {"role": "assistant", "tool_calls": [{**CALL, "function": v}]})),
    (CHAT, "messages", lambda v: chat(USER, {"role": "assistant", "tool_calls": [{**CALL, **function(arguments=v)}]})),
    (CHAT, "messages", lambda v: chat({"role": "tool", "content": "1", "tool_call_id": v})),
    (CHAT, "messages", lambda v: chat({**USER, "name": v})),
    (CHAT, "tools", lambda v: chat(USER, tools=[v])),
    (CHAT, "tools", lambda v: chat(USER, tools=[{"type": "function", "function": {"name": v}}])),
    (CHAT, "tools", lambda v: chat(USER, tools=[function(parameters=v)])),
    (CHAT, "tools", lambda v: chat(USER, tools=[function(strict=v)])),
    (CHAT, "logit_bias", lambda v: chat(USER, logit_bias={"70": v})),
    (CHAT, "stop", lambda v: chat(USER, stop=[v])),
    (RESPONSES, "input", lambda v: {"input": [v]}),
    (RESPONSES, "input", lambda v: {"input": [{"role": "user", "content": v}]}),
    (RESPONSES, "input", lambda v: {"input": [{"role": v, "content": "x"}]}),
    (RESPONSES, "input", lambda v: {"input": [USER, {"type": "function_call", "call_id": "c", "name": v}]}),
    (RESPONSES, "input", lambda v: {"input": [USER, {**FUNCTION_CALL, "arguments": v}]}),
    (RESPONSES, "input", lambda v: {"input": [USER, {"type": "function_call_output", "call_id": "c", "output": v}]}),
    (RESPONSES, "input", lambda v: {"input": [USER, {"type": v, "call_id": "c", "output": "x"}]}),
    (RESPONSES, "tools", lambda v: {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": v}]}),
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The sequential server: a 65,536-token context, no EOS, --request-timeout 2, --read-timeout 2."""
    root = tmp_path_factory.mktemp("hostile")
    tiny_kha(root / "kha", max_positions=65536, eos=False, chat_template=SLOW_TEMPLATE)
    port = free_port()
    limits = ServeLimits(
        max_new_tokens=LIMIT,
        request_timeout=TIMEOUT,
        max_request_bytes=256 * 1024,
        read_timeout=READ_TIMEOUT,
        max_connections=MAX_CONNECTIONS,
    )
    server = start_server(str(root / "kha"), port=port, device="cpu", dtype="float32", limits=limits)
    yield f"http://127.0.0.1:{port}", server, root / "kha"
    server.kill_server()


@pytest.fixture(scope="module")
def batching(tmp_path_factory):
    """The continuous-batching server: a 16,384-token context, no EOS, --request-timeout 2, a paged cache of
    CB_BLOCKS blocks of 256 tokens."""
    root = tmp_path_factory.mktemp("batching")
    tiny_kha(root / "kha", max_positions=16384, eos=False)
    port = free_port()
    limits = ServeLimits(max_new_tokens=8000, request_timeout=TIMEOUT, max_request_bytes=256 * 1024)
    server = start_server(
        str(root / "kha"),
        port=port,
        device="cpu",
        dtype="float32",
        continuous_batching=True,
        cb_num_blocks=CB_BLOCKS,
        limits=limits,
    )
    yield f"http://127.0.0.1:{port}", server, root / "kha"
    server.kill_server()


# `requests` keeps a connection open while its Response object lives, and the server caps open connections: the
# tests that hold many responses ask the server to close each connection after its answer
CLOSE = {"connection": "close"}


def post(base: str, path: str, body, timeout: float = 120) -> requests.Response:
    return requests.post(f"{base}{path}", json=body, headers=CLOSE, timeout=timeout)


def post_raw(base: str, path: str, data: bytes, timeout: float = 120) -> requests.Response:
    headers = {"content-type": "application/json", **CLOSE}
    return requests.post(f"{base}{path}", data=data, headers=headers, timeout=timeout)


def error_param(response: requests.Response):
    return response.json()["error"]["param"]


def assert_live(base: str) -> None:
    assert requests.get(f"{base}/health", timeout=30).status_code == 200
    response = post(base, COMPLETIONS, {"prompt": "the", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text


def greedy(folder, messages=None, prompt=None, new_tokens: int = 6) -> str:
    model = KHAForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if messages is not None:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def streamed(stream: bool) -> dict:
    """The fields of a request that streams (or not), the usage included (transformers >= 5.25, as OpenAI, sends it
    in a last chunk of its own when asked)."""
    return {"stream": True, "stream_options": {"include_usage": True}} if stream else {"stream": False}


def finish_and_tokens(response: requests.Response, stream: bool) -> tuple[str, int]:
    """The reply's finish_reason and completion tokens, streamed (asked with `streamed(True)`: the last chunk with a
    choice says the first, the usage chunk the second) or not."""
    if not stream:
        reply = response.json()
        return reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    [finish] = [
        chunk["choices"][0]["finish_reason"]
        for chunk in chunks
        if (chunk.get("choices") or [{}])[0].get("finish_reason")
    ]
    [usage] = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    return finish, usage["completion_tokens"]


# ---------------------------------------------------------------- the allowlist: every field, every endpoint


def test_every_field_of_every_endpoint_with_wrong_values_gets_4xx_or_200_never_500(hostile):
    """Each field of each endpoint (and fields no endpoint takes), then each field inside messages, tools and
    input items, with wrong types, extremes and deep nesting: 4xx naming the field, or 200; the server lives."""
    base, server, _ = hostile
    cases = [(path, name, {**BASE[path], name: value}) for path in FIELDS for name in FIELDS[path] for value in WRONG]
    for path, field, make in NESTED:
        base_body = {key: value for key, value in BASE[path].items() if key not in ("messages", "input")}
        cases += [(path, field, {**base_body, **make(value)}) for value in WRONG]
    statuses = {}

    def send(case):
        path, field, body = case
        return case, post(base, path, body, timeout=60)

    with ThreadPoolExecutor(max_workers=4) as pool:
        for (path, field, body), response in pool.map(send, cases):
            status = response.status_code
            statuses[status] = statuses.get(status, 0) + 1
            shown = json.dumps(body)[:300]
            assert status == 200 or 400 <= status < 500, f"{path} {shown}: {status} {response.text[:300]}"
            if status == 400:  # the refusal names the field (or the field it sits in)
                param = error_param(response)
                assert param and param.startswith(field), f"{path} {shown}: param {param!r}"
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 500, statuses  # both kinds were exercised
    assert_live(base)
    assert server.kha_registry.longest_running() < TIMEOUT + 30


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [  # the cases of issue #28, item 11, each once
        (CHAT, {"messages": MESSAGES, "tools": "abc"}, "tools"),
        (CHAT, {"messages": MESSAGES, "tools": [1, 2]}, "tools[0]"),
        (CHAT, {"messages": MESSAGES, "frequency_penalty": "abc"}, "frequency_penalty"),
        (CHAT, {"messages": MESSAGES, "frequency_penalty": -1}, "frequency_penalty"),
        (CHAT, {"messages": MESSAGES, "logit_bias": [1, 2]}, "logit_bias"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"99999999": 1}}, "logit_bias"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {"70": "x"}}, "logit_bias[70]"),
        (CHAT, {"messages": MESSAGES, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        (CHAT, {"messages": MESSAGES, "seed": 2**64}, "seed"),
        (CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": [1]}}, "chat_template_kwargs"),
        (CHAT, {"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [5]}]}, "messages[1].tool_calls[0]"),
        (
            CHAT,
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        (COMPLETIONS, {"prompt": "x", "suffix": 5}, "suffix"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"70": 1}}, "logit_bias"),  # not applied by completions
        (RESPONSES, {"input": ["hello"]}, "input[0]"),
        (RESPONSES, {"input": [1]}, "input[0]"),
        (RESPONSES, {"input": []}, "input"),
        (RESPONSES, {"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        (RESPONSES, {"input": "x", "instructions": [1]}, "instructions"),
    ],
)
def test_malformed_fields_of_issue_28_get_400_naming_the_field(hostile, path, body, param):
    base, _, _ = hostile
    response = post(base, path, {"max_tokens" if path != RESPONSES else "max_output_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert error_param(response) == param


def test_non_finite_numbers_deep_nesting_and_lone_surrogates_get_400(hostile):
    base, _, _ = hostile
    for raw in (
        b'{"prompt": "x", "suffix": "\\ud800"}',  # JSON allows it; transformers fails encoding it (500)
        b'{"prompt": "x", "stop": ["\\udfff"]}',
        b'{"prompt": "x", "user": "ok", "\\ud800": 1}',
        b'{"messages": [{"role": "user", "content": "x"}], "frequency_penalty": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
        b'{"prompt": "x", "temperature": 1e999}',
        b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}",  # an int past a float: OverflowError, a 500 once
        b'{"prompt": "x", "top_p": 1' + b"0" * 400 + b"}",
        b'{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 1' + b"0" * 400 + b"}}",
        b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
        b"[" * 30000 + b"]" * 30000,  # RecursionError in json.loads
        b'{"prompt": "x", "user": ' + b"[" * 30000 + b"]" * 30000 + b"}",
    ):
        response = post_raw(base, COMPLETIONS, raw)
        assert response.status_code == 400, (raw[:60], response.text)
    assert_live(base)


def test_well_formed_requests_of_issue_28_are_answered(hostile):
    """What transformers 5.24 answered with a 500 although the request is valid OpenAI input."""
    base, _, folder = hostile
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # an empty prompt starts from the BOS token
    response = post(base, COMPLETIONS, {"prompt": "", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3
    # stop: [] means no stop strings
    response = post(base, CHAT, {"messages": MESSAGES, "max_tokens": 2, "stop": []})
    assert response.status_code == 200, response.text
    # an integer logit_bias is honoured (transformers wants floats): token 70 wins every step
    biased = post(base, CHAT, {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "logit_bias": {"70": 100}})
    assert biased.status_code == 200, biased.text
    assert biased.json()["choices"][0]["message"]["content"] == tokenizer.decode([70] * 4, skip_special_tokens=True)
    # tools in both forms, and a conversation that carries a tool call and its result
    tool = {"name": "add", "description": "adds", "parameters": {"type": "object", "properties": {}}}
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    conversation = [
        *MESSAGES,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    for path, body in (
        (CHAT, {"messages": conversation, "tools": [{"type": "function", "function": tool}], "max_tokens": 2}),
        (RESPONSES, {"input": "x", "tools": [{"type": "function", **tool}], "max_output_tokens": 2, "stream": False}),
        (RESPONSES, {"input": [{"type": "input_text", "text": "the"}], "max_output_tokens": 2, "stream": False}),
    ):
        response = post(base, path, body)
        assert response.status_code == 200, (path, response.text)


# ---------------------------------------------------------------- High 1: no client template, renders off the loop


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chat_template": "{% for i in range(40000) %}{% for j in range(40000) %}{% endfor %}{% endfor %}the"},
        {"chat_template": "{{ 'the ' * 2000000 }}"},
        {"padding": "max_length", "max_length": 10000000},
        {"enable_thinking": False},  # even a harmless one: the server's own --chat-template-kwargs apply
    ],
)
def test_a_client_cannot_pass_chat_template_kwargs(hostile, kwargs):
    base, _, _ = hostile
    for path, body in ((CHAT, {"messages": MESSAGES, "max_tokens": 3}), (RESPONSES, {"input": "x", "stream": False})):
        start = time.monotonic()
        response = post(base, path, {**body, "chat_template_kwargs": kwargs}, timeout=30)
        assert response.status_code == 400, response.text
        assert error_param(response) == "chat_template_kwargs"
        assert time.monotonic() - start < 10  # refused before anything is rendered
    assert_live(base)


# ---------------------------------------------------------------- High 2: stop lists are capped


def test_stop_lists_are_capped_by_count_and_length(hostile):
    base, server, _ = hostile
    chat = {"messages": MESSAGES, "max_tokens": 2}
    start = time.monotonic()
    response = post(base, CHAT, {**chat, "stop": [f"s{i}" for i in range(3000)]}, timeout=60)  # the issue's list
    assert response.status_code == 400 and error_param(response) == "stop"
    assert time.monotonic() - start < 10
    too_many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    assert error_param(post(base, CHAT, {**chat, "stop": too_many})) == "stop"
    assert error_param(post(base, CHAT, {**chat, "stop": ["x" * (MAX_STOP_CHARS + 1)]})) == "stop[0]"
    assert error_param(post(base, COMPLETIONS, {"prompt": "x", "stop": [""]})) == "stop[0]"
    longest = [chr(ord("a") + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]  # the most a request may ask
    response = post(base, CHAT, {**chat, "stop": longest}, timeout=60)
    assert response.status_code == 200, response.text
    assert server.kha_registry.longest_running() == 0


# ---------------------------------------------------------------- Low: a cut generation says "length"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_generation_cut_by_the_time_limit_ends_with_finish_reason_length(hostile, path, stream):
    base, _, _ = hostile
    body = {"max_tokens": LIMIT, "temperature": 0, **streamed(stream)}
    body.update({"prompt": "the"} if path == COMPLETIONS else {"messages": MESSAGES})
    start = time.monotonic()
    response = post(base, path, body, timeout=120)
    assert response.status_code == 200, response.text
    assert time.monotonic() - start < 60  # 60,000 tokens would take many minutes
    finish, tokens = finish_and_tokens(response, stream)
    assert finish == "length"
    assert 0 < tokens < LIMIT


# ---------------------------------------------------------------- Medium 12: connection timeouts and a cap


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _until_closed(sockets: dict[str, socket.socket], seconds: float, feed=None) -> dict[str, bytes]:
    """What each socket received until the server closed it; fails if one is still open after SECONDS. FEED(name,
    socket) runs every 0.3 s for the sockets still open (a client that keeps sending)."""
    received = {name: b"" for name in sockets}
    open_ = dict(sockets)
    deadline = time.monotonic() + seconds
    while open_ and time.monotonic() < deadline:
        readable, _, _ = select.select(list(open_.values()), [], [], 0.3)
        for name, sock in list(open_.items()):
            if sock in readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                received[name] += data
                if not data:
                    del open_[name]
            elif feed is not None:
                try:
                    feed(name, sock)
                except (BrokenPipeError, ConnectionResetError):
                    del open_[name]
    for sock in sockets.values():
        sock.close()
    assert not open_, f"still open after {seconds} s: {sorted(open_)}"
    return received


def test_idle_slow_and_endless_connections_are_closed(hostile):
    base, _, _ = hostile
    port = int(base.rsplit(":", 1)[1])
    sockets = {name: _connect(port) for name in ("idle", "trickled headers", "half body", "endless chunks")}
    sockets["half body"].sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
        b'{"prompt": '
    )
    sockets["endless chunks"].sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
    headers = iter(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-long: " + b"a" * 1000)

    def feed(name, sock):
        if name == "trickled headers":
            sock.sendall(bytes([next(headers)]))  # a byte every 0.3 s: each resets no timer
        elif name == "endless chunks":
            sock.sendall(b"1\r\n \r\n")

    received = _until_closed(sockets, 20, feed)  # --read-timeout is 2 s
    assert received["idle"].startswith(b"HTTP/1.1 408"), received["idle"]
    assert received["trickled headers"].startswith(b"HTTP/1.1 408"), received["trickled headers"]
    assert_live(base)


def test_connections_over_the_cap_are_refused_at_once_and_the_server_stays_live(hostile):
    base, _, _ = hostile
    port = int(base.rsplit(":", 1)[1])
    sockets = {str(i): _connect(port) for i in range(3 * MAX_CONNECTIONS)}
    received = _until_closed(sockets, 20)  # the refused at once, the others after --read-timeout
    refused = sum(data.startswith(b"HTTP/1.1 503") for data in received.values())
    timed_out = sum(data.startswith(b"HTTP/1.1 408") for data in received.values())
    assert refused >= 2 * MAX_CONNECTIONS and 1 <= timed_out <= MAX_CONNECTIONS, (refused, timed_out)
    assert_live(base)


# ---------------------------------------------------------------- High 3: continuous batching


@pytest.mark.parametrize("stream", [False, True])
def test_continuous_batching_honours_the_request_timeout(batching, stream):
    base, server, _ = batching
    body = {"prompt": "the", "max_tokens": 8000, "temperature": 0, **streamed(stream)}
    start = time.monotonic()
    response = post(base, COMPLETIONS, body, timeout=120)
    assert response.status_code == 200, response.text
    assert time.monotonic() - start < 60  # 8,000 tokens took 120 s with --request-timeout 5 before
    finish, tokens = finish_and_tokens(response, stream)
    assert finish == "length" and 0 < tokens < 8000
    deadline = time.monotonic() + 15
    while server.kha_registry.longest_running() > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.kha_registry.longest_running() == 0  # the request left the scheduler
    assert_live(base)


def test_continuous_batching_cuts_a_request_to_its_cache(batching):
    """One request longer than the paged cache killed transformers 5.24's batch loop ("No requests can be
    scheduled and no requests can be offloaded"), and every later request got 503: now its new tokens are cut to
    what the cache holds, and a prompt longer than the cache gets 400."""
    base, _, folder = batching
    cache = CB_BLOCKS * 256
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = "the quick " * 150
    assert cache // 2 < len(tokenizer(prompt).input_ids) < cache < 16384  # fits the context and the cache
    response = post(base, COMPLETIONS, {"prompt": prompt, "max_tokens": 8000})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] <= cache
    response = post(base, COMPLETIONS, {"prompt": prompt * 2, "max_tokens": 2})  # fits the context only
    assert response.status_code == 400 and "KV cache" in response.text, response.text
    assert_live(base)


def test_continuous_batching_admits_requests_after_cut_ones_outgrew_its_cache(batching):
    """Two requests that together outgrow the paged cache make transformers 5.25's batch offload one and admit no new
    request until a request finishes; cut by their time limit, they never finish, and every later request waited
    for good (503): kha serve lets the batch admit again once the cut ones are gone."""
    base, _, folder = batching
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = ["the quick " * 80, "over the lazy dog " * 53]
    lengths = [len(tokenizer(prompt).input_ids) for prompt in prompts]
    assert sum(lengths) < CB_BLOCKS * 256 < sum(lengths) + 600, lengths  # both fit in the cache, their answers not

    def send(prompt):
        return post(base, COMPLETIONS, {"prompt": prompt, "max_tokens": 8000})

    with ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(send, prompts))
    assert all(response.status_code in (200, 503) for response in responses), [r.text for r in responses]
    assert_live(base)


def test_continuous_batching_tracks_its_generations_for_health(batching):
    base, server, _ = batching
    body = {"prompt": "the", "max_tokens": 8000, "temperature": 0, "stream": True}
    with requests.post(f"{base}{COMPLETIONS}", json=body, stream=True, timeout=(10, 60)) as response:
        next(response.iter_content(chunk_size=16))  # the request is in: the batching thread picks it up soon
        # the first chunk can come before the batching thread has begun the generation (CI, 2026-12-03): wait for it
        deadline = time.monotonic() + 30
        while server.kha_registry.longest_running() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.kha_registry.longest_running() > 0
        assert requests.get(f"{base}/health", timeout=30).status_code == 200  # within its time limit


@pytest.mark.parametrize(("field", "value"), [("logit_bias", {"70": 100}), ("frequency_penalty", 0.5), ("stop", ["x"])])
def test_continuous_batching_refuses_per_request_settings_it_cannot_keep_to_the_request(batching, field, value):
    """transformers 5.24 built its batch manager from the first request's settings and applied them to every
    later client (a logit_bias made everyone's replies 'ffff'); 5.25 still applies these to the whole batch: they
    get 400, and the next client gets the model's own greedy reply."""
    base, _, folder = batching
    body = {"messages": MESSAGES, "max_tokens": 6}  # the model's generation config decodes greedily
    response = post(base, CHAT, {**body, field: value})
    assert response.status_code == 400, response.text
    assert error_param(response) == field and "continuous-batching" in response.text
    plain = post(base, CHAT, body)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["message"]["content"] == greedy(folder, messages=MESSAGES)


def _texts(lines) -> str:
    """The text of the completion chunks among LINES (of an SSE stream)."""
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk.get("choices"))


def test_continuous_batching_keeps_each_request_s_temperature_and_top_p_to_itself(batching):
    """transformers 5.25 lets each request of a batch set its own temperature and top_p (kha serve refused them
    with 5.24, which sampled every request with the first one's): a greedy request gets the same tokens alone and
    while requests at temperature 2 share its batches, whose own tokens are sampled; a top_p that keeps one token
    makes a request at temperature 2 greedy again; a seed while sampling is still refused (one random generator)."""
    base, _, folder = batching
    new_tokens = 24
    expected = greedy(folder, prompt="the quick", new_tokens=new_tokens)
    plain = {"prompt": "the quick", "max_tokens": new_tokens, "temperature": 0}
    alone = post(base, COMPLETIONS, plain)
    assert alone.status_code == 200, alone.text
    assert alone.json()["choices"][0]["text"] == expected
    hot = {"prompt": "the quick", "max_tokens": 4000, "temperature": 2.0, "stream": True}  # cut by the time limit
    streams = [requests.post(f"{base}{COMPLETIONS}", json=hot, stream=True, timeout=(10, 60)) for _ in range(2)]
    try:
        for stream in streams:
            assert stream.status_code == 200, stream.text
        lines = [stream.iter_lines(decode_unicode=True) for stream in streams]
        firsts = [next(line for line in stream_lines if line) for stream_lines in lines]  # the hot requests generate
        beside = post(base, COMPLETIONS, plain)
        hot_texts = [_texts([first, *rest]) for first, rest in zip(firsts, lines, strict=True)]
    finally:
        for stream in streams:
            stream.close()
    assert beside.status_code == 200, beside.text
    assert beside.json()["choices"][0]["text"] == expected
    assert all(text and not text.startswith(expected) for text in hot_texts), hot_texts  # sampled, not greedy
    narrow = post(base, COMPLETIONS, {**plain, "temperature": 2.0, "top_p": 1e-6})
    assert narrow.status_code == 200, narrow.text
    assert narrow.json()["choices"][0]["text"] == expected
    seeded = post(base, COMPLETIONS, {**plain, "temperature": 0.7, "seed": 1})
    assert seeded.status_code == 400 and error_param(seeded) == "seed", seeded.text
    assert_live(base)


def test_continuous_batching_accepts_settings_equal_to_the_servers(batching):
    base, _, folder = batching
    expected = greedy(folder, messages=MESSAGES)
    for extra in (
        {"temperature": 0},
        {"temperature": 0, "top_p": 0.5},  # greedy: top_p changes nothing
        {"frequency_penalty": 0},
        {"seed": 5},  # greedy: no random numbers are drawn
        {"logit_bias": {}},
        {"stop": []},
    ):
        response = post(base, CHAT, {"messages": MESSAGES, "max_tokens": 6, **extra})
        assert response.status_code == 200, (extra, response.text)
        assert response.json()["choices"][0]["message"]["content"] == expected, extra


def test_health_reports_a_cancelled_generation_that_never_leaves_the_batch():
    """A continuous-batching request cut by its time limit counts as running until the batch drops it: a batch
    loop that never runs again is a stuck server."""
    import asyncio

    async def app(scope, receive, send):  # transformers' app stands in: /health answers 200
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"status":"ok"}'})

    def health(guard) -> int:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        asyncio.run(guard({"type": "http", "method": "GET", "path": "/health", "headers": []}, receive, send))
        return sent[0]["status"]

    registry = RequestRegistry()
    guard = ServeGuard(app, "/m", {"/m"}, ServeLimits(request_timeout=5), registry)
    request, in_batch = object(), [True]
    registry.begin(request)
    registry.running[id(request)] -= 40  # started 40 s ago: past 5 s + 30 s of grace
    registry.end(request, still_running=lambda: in_batch[0])  # cancelled, still in the batch
    assert health(guard) == 503
    in_batch[0] = False  # the batch dropped it
    assert health(guard) == 200 and registry.longest_running() == 0


# ---------------------------------------------------------------- High 1: rendering runs off the event loop


def test_a_slow_render_runs_off_the_event_loop_under_the_time_limit(hostile):
    """The render is stopped at the time limit (round 5), and the request has its 408."""
    base, _, _ = hostile
    body = {"messages": [{"role": "user", "content": SLOW}], "max_tokens": 2}
    with ThreadPoolExecutor(max_workers=1) as pool:
        slow = pool.submit(post, base, CHAT, body, 60)
        time.sleep(0.5)
        health = [requests.get(f"{base}/health", timeout=5).status_code for _ in range(3)]  # during the render
        quick = post(base, COMPLETIONS, {"prompt": "the", "max_tokens": 2}, timeout=30)
        response = slow.result()
    assert health == [200, 200, 200]
    assert quick.status_code == 200, quick.text
    assert response.status_code == 408, response.text
    assert "--request-timeout" in response.text and error_param(response) == "messages"


# ---------------------------------------------------------------- the attack on round 4 (helper report)


def test_a_header_block_over_the_cap_is_refused_even_when_it_arrives_at_once(hostile):
    base, _, _ = hostile
    headers = {"content-type": "application/json", "x-a": "a" * 60000, **CLOSE}
    response = requests.post(f"{base}{COMPLETIONS}", json={"prompt": "the", "max_tokens": 2}, headers=headers)
    assert response.status_code == 431, response.text
    assert "limit" in response.json()["error"]["message"]
    assert_live(base)


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_a_json_body_with_a_json_content_type_is_answered(hostile, content_type):
    """Any other content type is refused (415, round 5: test_serve_round5.py)."""
    base, _, _ = hostile
    headers = {**CLOSE, "content-type": content_type}
    data = json.dumps({"prompt": "the", "max_tokens": 2, "temperature": 0}).encode()
    response = requests.post(f"{base}{COMPLETIONS}", data=data, headers=headers, timeout=120)
    assert response.status_code == 200, response.text


def test_time_waiting_behind_other_requests_counts_toward_the_time_limit(hostile):
    """Six long requests at once on the sequential path: each ends within its --request-timeout of being sent
    (cut with finish_reason "length", or 503 when its time ran out in the queue), never one after another's."""
    base, _, _ = hostile
    body = {"prompt": "the", "max_tokens": LIMIT, "temperature": 0}

    def timed(_):
        start = time.monotonic()
        response = post(base, COMPLETIONS, body, timeout=120)
        return response.status_code, time.monotonic() - start, response, start, time.monotonic()

    with ThreadPoolExecutor(6) as pool:
        timings = list(pool.map(timed, range(6)))
    results = [t[:3] for t in timings]
    # The test shows something only if every request was sent before the first was answered: then, on the
    # sequential path, five of them waited behind others (whether they then got a few tokens or a 503 depends
    # on how far apart they arrived, so the status alone cannot tell)
    assert max(t[3] for t in timings) < min(t[4] for t in timings), "the requests did not overlap"
    for status, seconds, response in results:
        assert status in (200, 503), response.text
        assert seconds < TIMEOUT + 8, [
            (s, round(t, 1)) for s, t, _ in results
        ]  # 6 x TIMEOUT if queued time did not count
        if status == 503:
            assert "busy" in response.json()["error"]["message"]
        else:
            assert response.json()["choices"][0]["finish_reason"] == "length"
    assert_live(base)
