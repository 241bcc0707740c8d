"""`kha serve`, safety round 5: what a hostile review found, each with the request (or checkpoint) that showed it."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kha_hf.checkpoint.loading import check_processor_bounds
from kha_hf.common.errors import KHAError
from kha_hf.serving.guard import ServeLimits
from tests.helpers import free_port
from tests.serving.servers import CHAT_TEMPLATE, tiny_kha

pytest.importorskip("fastapi")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TIMEOUT = 3  # the server's --request-timeout
# a template whose render never ends for one message (10^10 iterations), and renders at once otherwise
ENDLESS = "render forever"
ENDLESS_TEMPLATE = (
    "{% if messages[0]['content'] == '" + ENDLESS + "' %}{% set ns = namespace(n=0) %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}"
    "{% endif %}" + CHAT_TEMPLATE
)
CLOSE = {"connection": "close"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A sequential server for a tiny KHA model without EOS, --request-timeout TIMEOUT."""
    from kha_hf.serving.server import start_server

    root = tmp_path_factory.mktemp("round5")
    tiny_kha(root / "kha", max_positions=4096, eos=False, chat_template=ENDLESS_TEMPLATE)
    port = free_port()
    limits = ServeLimits(max_new_tokens=256, request_timeout=TIMEOUT)
    running = start_server(str(root / "kha"), port=port, device="cpu", dtype="float32", limits=limits)
    yield f"http://127.0.0.1:{port}", running, root / "kha"
    running.kill_server()


def post(base: str, path: str, body, timeout: float = 120, **headers) -> requests.Response:
    return requests.post(f"{base}{path}", json=body, headers={**CLOSE, **headers}, timeout=timeout)


def completion_text(response: requests.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


# ---------------------------------------------------------------- item 2: a processor that resizes to gigabytes


def _gemma3_kha(folder):
    from kha_hf.conversion import convert
    from tests.multimodal_helpers import save_gemma3_with_processor

    save_gemma3_with_processor(folder / "base")
    convert(folder / "base", folder / "kha", knock="mlp_v", progress=False)
    return folder / "kha"


def _edit_image_processor(folder, **fields):
    path = folder / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_processor"].update(fields)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"size": {"height": 20000, "width": 20000}}, "size.height"),
        ({"pan_and_scan_max_num_crops": 100000, "do_pan_and_scan": True}, "pan_and_scan_max_num_crops"),
        ({"max_pixels": 10**10}, "max_pixels"),
        ({"crop_size": 50000}, "crop_size"),
    ],
)
def test_serve_and_convert_refuse_a_processor_that_resizes_an_image_to_gigabytes(tmp_path, fields, named):
    """A 28 x 28 PNG resized to 20000 x 20000 grew the server past 5.5 GB: refused in one line at start, before
    anything loads (so no memory is spent), and by kha convert."""
    import subprocess
    import sys

    from kha_hf.serving.server import check_serve_inputs, start_server

    folder = _gemma3_kha(tmp_path)
    _edit_image_processor(folder, **fields)
    with pytest.raises(KHAError) as err:
        check_serve_inputs(str(folder), "cpu", "float32", False, ServeLimits())
    assert named in str(err.value) and "\n" not in str(err.value)
    started = time.monotonic()
    with pytest.raises(KHAError, match=named):
        start_server(str(folder), port=free_port(), device="cpu", dtype="float32")
    assert time.monotonic() - started < 5  # refused before the model's process is spawned
    result = subprocess.run(
        [sys.executable, "-m", "kha_hf.cli.__init__", "convert", str(folder), str(tmp_path / "again")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and named in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "again").exists()
    if named == "size.height":  # the memory bound, measured: kha serve as a child process, its peak RSS
        from tests.conversion.test_gguf_header import peak_rss_mb

        rc, stderr, peak = peak_rss_mb(["serve", str(folder), "--port", str(free_port())], timeout=120)
        assert rc == 2 and named in stderr.strip().splitlines()[-1], stderr[-2000:]
        assert peak < 1500, f"peak RSS {peak:.0f} MB"  # was past 5.5 GB after one request


@pytest.mark.parametrize(
    "image_processor",
    [
        {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896}},
        {"image_processor_type": "Gemma3ImageProcessor", "pan_and_scan_max_num_crops": 4, "size": 896},
        {  # Qwen2.5-VL: size in pixels
            "image_processor_type": "Qwen2VLImageProcessor",
            "max_pixels": 12845056,
            "min_pixels": 3136,
            "size": {"longest_edge": 12845056, "shortest_edge": 3136},
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
        },
        {  # Qwen3-VL
            "image_processor_type": "Qwen2VLImageProcessorFast",
            "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "patch_size": 16,
        },
        {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 1456}, "max_image_size": 364},
        {"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": 1024}, "patch_size": 16},
        {"image_processor_type": "MllamaImageProcessor", "size": {"height": 560, "width": 560}, "max_image_tiles": 4},
    ],
)
def test_released_processors_fit_the_bounds(tmp_path, image_processor):
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": image_processor}))
    check_processor_bounds(tmp_path)
    (tmp_path / "processor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image_processor))
    check_processor_bounds(tmp_path)


def test_a_side_written_as_a_qwen_pixel_budget_is_still_refused_for_other_processors(tmp_path):
    config = {"image_processor_type": "Gemma3ImageProcessor", "size": {"longest_edge": 12845056}, "merge_size": 2}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(KHAError, match="size.longest_edge"):
        check_processor_bounds(tmp_path)


# ---------------------------------------------------------------- item 3: a seed is the request's own


def test_a_seed_stays_with_its_request(server):
    """transformers seeded the process-wide generator with a request's seed: the sampled text of the next request
    without a seed then followed from it (the same every time). Now a seeded request repeats its text, alone or
    after others, and leaves the process's random numbers as they were."""
    base, _, _ = server
    seeded = {"prompt": "the quick", "max_tokens": 24, "temperature": 1.5, "seed": 42}
    unseeded = {"prompt": "the quick", "max_tokens": 24, "temperature": 1.5}
    texts = []
    for _ in range(2):
        first = completion_text(post(base, COMPLETIONS, seeded))
        texts.append((first, completion_text(post(base, COMPLETIONS, unseeded))))
    (first_a, after_a), (first_b, after_b) = texts
    assert first_a == first_b  # the seed repeats its text
    assert after_a != after_b  # the next client's random numbers are not the seeding client's

    def sample(body):
        return completion_text(post(base, COMPLETIONS, body))

    with ThreadPoolExecutor(3) as pool:  # with other sampling requests at once
        results = list(pool.map(sample, [unseeded, seeded, unseeded]))
    assert results[1] == first_a


# ---------------------------------------------------------------- item 5: a client types the processor's image tokens


def _image_part():
    import base64
    import io

    from tests.multimodal_helpers import tiny_image

    buffer = io.BytesIO()
    tiny_image().save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_every_image_token_typed_by_a_client_is_a_400_naming_it(tmp_path):
    """Gemma 3's `<image_soft_token>` typed beside an image was a 500 (image features and image tokens do not
    match), and alone it was fed as a placeholder without features: each of the processor's image tokens
    (start_of_image, image_soft_token, end_of_image), typed in a text part or a string content, with or without an
    image, is a 400 naming it; the server goes on."""
    from transformers import AutoProcessor

    from kha_hf.serving.server import start_server

    folder = _gemma3_kha(tmp_path)
    processor = AutoProcessor.from_pretrained(folder)
    tokenizer = processor.tokenizer
    tokens = {processor.image_token, tokenizer.image_token, tokenizer.boi_token, tokenizer.eoi_token}
    assert tokens == {"<image_soft_token>", "<start_of_image>", "<end_of_image>"}
    port = free_port()
    running = start_server(str(folder), port=port, device="cpu", dtype="float32")
    base = f"http://127.0.0.1:{port}"
    try:
        for token in sorted(tokens):
            for parts in ([_image_part()], []):
                content = [*parts, {"type": "text", "text": f"the fox {token} jumps"}]
                body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
                response = post(base, CHAT, body)
                assert response.status_code == 400, (token, len(parts), response.text)
                error = response.json()["error"]
                assert token in error["message"] and error["param"] == "messages", error
        body = {"messages": [{"role": "user", "content": [_image_part(), {"type": "text", "text": "the fox"}]}]}
        assert post(base, CHAT, {**body, "max_tokens": 3}).status_code == 200
    finally:
        running.kill_server()


# ---------------------------------------------------------------- item 10: CSRF and DNS rebinding


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_post_without_a_json_content_type_is_a_415(server, content_type):
    """A web page may send these to the loopback server without a preflight (CSRF): refused before generating."""
    base, _, _ = server
    headers = {**CLOSE, **({"content-type": content_type} if content_type else {})}
    data = json.dumps({"prompt": "the", "max_tokens": 2, "temperature": 0}).encode()
    for path in (COMPLETIONS, CHAT):
        response = requests.post(f"{base}{path}", data=data, headers=headers, timeout=60)
        assert response.status_code == 415, response.text
        assert "application/json" in response.json()["error"]["message"]
    preflight = requests.options(f"{base}{COMPLETIONS}", headers={"origin": "http://evil.example"}, timeout=30)
    assert preflight.status_code >= 400  # a page cannot get leave to send JSON


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example:{port}", ""])
def test_a_foreign_host_header_is_refused_on_a_loopback_server(server, host):
    """DNS rebinding: a page whose name now resolves to 127.0.0.1 would read the answers; its Host is refused."""
    base, _, _ = server
    port = base.rsplit(":", 1)[1]
    headers = {**CLOSE, "host": host.format(port=port)}
    for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", COMPLETIONS)):
        response = requests.request(
            method, f"{base}{path}", json={"prompt": "the", "max_tokens": 2}, headers=headers, timeout=60
        )
        assert response.status_code == 421, (method, path, response.text)


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "localhost", "LOCALHOST"])
def test_loopback_host_headers_are_answered(server, host):
    base, _, _ = server
    port = base.rsplit(":", 1)[1]
    response = requests.get(f"{base}/health", headers={**CLOSE, "host": host.format(port=port)}, timeout=30)
    assert response.status_code == 200, response.text


def test_a_server_bound_to_every_address_takes_any_host():
    from kha_hf.serving.guard import allowed_host_headers

    assert allowed_host_headers("0.0.0.0", 8000) is None and allowed_host_headers("192.168.1.5", 8000) is None
    assert b"localhost:8000" in allowed_host_headers("127.0.0.1", 8000)
    assert b"[::1]:8000" in allowed_host_headers("::1", 8000)


# ---------------------------------------------------------------- item 15: the image cap before any image is read


def test_6000_image_parts_are_refused_before_any_is_decoded(monkeypatch):
    """8 clients each sending 6,000 one-pixel PNGs slowed /health: every part was decoded before the cap of
    MAX_IMAGES was checked. The parts are counted first; no image is opened."""
    import base64
    import io

    from PIL import Image

    from kha_hf.serving.errors import RequestError
    from kha_hf.serving.fields import MAX_IMAGES, checked_fields

    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append(1) or real_open(*args, **kwargs))
    part = {"type": "image_url", "image_url": {"url": url}}
    messages = [{"role": "user", "content": [part] * 1000} for _ in range(6)]
    with pytest.raises(RequestError) as err:
        checked_fields({"messages": messages}, CHAT, 16, images=True)
    assert err.value.status == 400 and "6000 images" in err.value.message
    assert opened == []
    checked_fields({"messages": [{"role": "user", "content": [part] * MAX_IMAGES}]}, CHAT, 16, images=True)
    assert len(opened) == MAX_IMAGES  # the check does open images under the cap (the patch counts)


# ---------------------------------------------------------------- item 11: an endless render gives its thread back


def test_an_endless_render_is_stopped_at_its_time_limit_and_the_server_goes_on(server):
    """A checkpoint's template with nested loops (10^10 iterations) kept both render threads busy for good: every
    later request got 408, /health 503. Each such render is stopped at its --request-timeout; chat requests after
    them are answered, and /health says 200."""
    base, running, _ = server
    endless = {"messages": [{"role": "user", "content": ENDLESS}], "max_tokens": 2}
    plain = {"messages": [{"role": "user", "content": "the lazy dog"}], "max_tokens": 2}

    def timed(body):
        start = time.monotonic()
        response = post(base, CHAT, body, timeout=120)
        return response, time.monotonic() - start

    with ThreadPoolExecutor(3) as pool:  # more endless renders than render threads
        results = list(pool.map(timed, [endless] * 3))
    for response, seconds in results:
        assert response.status_code == 408, response.text
        assert seconds < 2 * TIMEOUT + 5  # the third waited for a thread, within its own limit
    started = time.monotonic()
    for _ in range(3):
        response = post(base, CHAT, plain, timeout=60)
        assert response.status_code == 200, response.text
    assert time.monotonic() - started < 30
    assert requests.get(f"{base}/health", headers=CLOSE, timeout=30).status_code == 200
    deadline = time.monotonic() + 10
    while running.kha_registry.longest_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running.kha_registry.longest_running() == 0  # no render still counts as running


# ---------------------------------------------------------------- item 16: a missing Hub id, in one line


def test_serving_a_missing_hub_id_is_a_one_line_error(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [sys.executable, "-m", "kha_hf.cli.__init__", "serve", "nobody-kha/no-such-model", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nobody-kha/no-such-model" in lines[0], result.stderr


def test_6000_image_parts_cost_no_memory_of_decoding():
    """Item 15's bound, measured: 8 requests of 6,000 image parts each (the attack's 8 clients) go through the
    field checks in a child process whose peak RSS stays at that of the interpreter with the serving modules."""
    import json as json_module
    import subprocess
    import sys

    probe = """
import base64, io, json, resource
from PIL import Image
from kha_hf.serving.errors import RequestError
from kha_hf.serving.fields import checked_fields
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
buffer = io.BytesIO()
Image.new("RGB", (1, 1)).save(buffer, format="PNG")
url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
part = {"type": "image_url", "image_url": {"url": url}}
refused = 0
for _ in range(8):
    try:
        body = {"messages": [{"role": "user", "content": [part] * 6000}]}
        checked_fields(body, "/v1/chat/completions", 16, images=True)
    except RequestError as err:
        refused += err.status == 400
print(json.dumps([refused, before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]))
"""
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    refused, before, peak = json_module.loads(run.stdout.strip().splitlines()[-1])
    assert refused == 8
    assert peak - before < 100, f"the checks grew the process by {peak - before:.0f} MB"
