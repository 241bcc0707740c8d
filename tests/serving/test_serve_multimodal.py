"""`kha serve` of a multimodal KHA model (Gemma 3, tiny, with its processor): a chat request with an image, through
the `openai` client, gets the text that `generate` gives for the same rendered prompt and image."""

import base64
import io

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from kha_hf.conversion import convert
from tests.helpers import free_port, randomize_knocks
from tests.multimodal_helpers import save_gemma3_with_processor, tiny_image

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

NEW_TOKENS = 6


def test_a_chat_request_with_an_image_gets_what_generate_gives(tmp_path):
    from kha_hf.serving.server import start_server

    save_gemma3_with_processor(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", knock="mlp_v", progress=False)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "kha").eval()
    randomize_knocks(model, scale=0.5)
    model.save_pretrained(tmp_path / "kha", safe_serialization=True)
    processor = AutoProcessor.from_pretrained(tmp_path / "kha")

    buffer = io.BytesIO()
    tiny_image().save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    request = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "the fox jumps"}],
        }
    ]
    local = [
        {
            "role": "user",
            "content": [{"type": "image", "image": tiny_image()}, {"type": "text", "text": "the fox jumps"}],
        }
    ]
    inputs = processor.apply_chat_template(
        local, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert int((inputs["input_ids"] == model.config.image_token_index).sum()) == 4, "the image is not in the prompt"
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    expected = processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    with torch.no_grad():
        without_image = model.generate(
            **processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "text", "text": "the fox jumps"}]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
            ),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    assert processor.decode(without_image[0, -NEW_TOKENS:], skip_special_tokens=True) != expected

    port = free_port()
    server = start_server(str(tmp_path / "kha"), port=port, device="cpu", dtype="float32")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        reply = client.chat.completions.create(
            model=str(tmp_path / "kha"), messages=request, max_tokens=NEW_TOKENS, temperature=0
        )
        assert reply.choices[0].message.content == expected
    finally:
        server.kill_server()


def _post(port: int, body: dict) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _image_request(folder) -> dict:
    buffer = io.BytesIO()
    tiny_image().save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "the fox"}]
    return {"model": str(folder), "messages": [{"role": "user", "content": parts}], "max_tokens": 3}


def test_a_multimodal_model_without_processor_files_serves_text(tmp_path):
    """A conversion of a checkpoint without its image processor (kha convert says so) still serves, as a text
    model: text chats are answered, image parts refused in one line."""
    from kha_hf.checkpoint.loading import PROCESSOR_FILES
    from kha_hf.serving.server import start_server

    save_gemma3_with_processor(tmp_path / "base")
    for name in PROCESSOR_FILES:
        (tmp_path / "base" / name).unlink(missing_ok=True)
    # the tokenizer's own template, for string contents (the tiny processor's renders parts only)
    (tmp_path / "base" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    convert(tmp_path / "base", tmp_path / "kha", knock="mlp_v", progress=False)
    port = free_port()
    server = start_server(str(tmp_path / "kha"), port=port, device="cpu", dtype="float32")
    try:
        text = {"model": str(tmp_path / "kha"), "messages": [{"role": "user", "content": "the fox"}], "max_tokens": 3}
        status, reply = _post(port, text)
        assert status == 200 and reply["choices"][0]["message"]["content"] is not None, reply
        status, reply = _post(port, _image_request(tmp_path / "kha"))
        assert status == 400 and "this model takes no images" in reply["error"]["message"], reply
    finally:
        server.kill_server()


def test_a_failure_inside_the_model_is_a_json_500_and_the_server_goes_on(tmp_path):
    """A processor that expands an image to 5 tokens for a model that makes 4 features of it: the model raises;
    the client gets OpenAI's error format, and the next request is answered."""
    import json

    from kha_hf.serving.server import start_server

    save_gemma3_with_processor(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", knock="mlp_v", progress=False)
    path = tmp_path / "kha" / "processor_config.json"
    config = json.loads(path.read_text())
    config["image_seq_length"] = 5
    path.write_text(json.dumps(config))
    port = free_port()
    server = start_server(str(tmp_path / "kha"), port=port, device="cpu", dtype="float32")
    try:
        status, reply = _post(port, _image_request(tmp_path / "kha"))
        assert status == 500 and reply["error"]["type"] == "server_error", reply
        text = {"model": str(tmp_path / "kha"), "messages": [{"role": "user", "content": "the fox"}], "max_tokens": 3}
        assert _post(port, text)[0] == 200
    finally:
        server.kill_server()


def test_text_that_holds_the_image_token_is_a_400(tmp_path):
    """Gemma 3's processor writes `<start_of_image>` for each image part and then requires as many in the text as
    there are images: a message that types the token itself is the client's error, answered 400 naming the token
    before the model runs, with or without an image; the server goes on (round 5: every image token, see
    test_serve_round5.py)."""
    from kha_hf.serving.server import start_server

    save_gemma3_with_processor(tmp_path / "base")
    convert(tmp_path / "base", tmp_path / "kha", knock="mlp_v", progress=False)
    token = AutoProcessor.from_pretrained(tmp_path / "kha").image_token
    with_image = _image_request(tmp_path / "kha")
    with_image["messages"][0]["content"][1]["text"] = f"the fox {token}"
    text_only = {
        "model": str(tmp_path / "kha"),
        "messages": [{"role": "user", "content": [{"type": "text", "text": f"{token} the fox"}]}],
        "max_tokens": 3,
    }
    port = free_port()
    server = start_server(str(tmp_path / "kha"), port=port, device="cpu", dtype="float32")
    try:
        for body in (with_image, text_only):
            status, reply = _post(port, body)
            assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
            assert reply["error"]["param"] == "messages", reply
            assert token in reply["error"]["message"], reply
        assert _post(port, _image_request(tmp_path / "kha"))[0] == 200
    finally:
        server.kill_server()
