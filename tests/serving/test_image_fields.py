"""Image parts in requests to `kha serve`: accepted only as inline data URLs of real images of bounded size, only in
chat messages, only by a multimodal model's server; every refusal is a 400 that names the field and the reason."""

import base64
import io

import pytest
from PIL import Image

from kha_hf.serving.errors import RequestError
from kha_hf.serving.fields import MAX_IMAGES, checked_fields


def _data_url(size=(28, 28), fmt="PNG") -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size).save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def _chat(*urls, text="what is this?"):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls] + [{"type": "text", "text": text}]
    return {"model": "m", "messages": [{"role": "user", "content": parts}]}


def _refused(body, path="/v1/chat/completions", images=True) -> RequestError:
    with pytest.raises(RequestError) as info:
        checked_fields(body, path, 16, images=images)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_a_multimodal_server_takes_inline_images(fmt):
    url = _data_url(fmt=fmt)
    checked = checked_fields(_chat(url), "/v1/chat/completions", 16, images=True)
    assert checked["messages"][0]["content"][0] == {"type": "image_url", "image_url": {"url": url}}


def test_a_text_model_refuses_image_parts():
    assert "this model takes no images" in _refused(_chat(_data_url()), images=False).message


@pytest.mark.parametrize(
    "part", [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "input_image", "image_url": "data:..."}]
)
def test_the_responses_endpoint_says_where_images_go(part):
    body = {"model": "m", "input": [{"role": "user", "content": [part]}]}
    error = _refused(body, path="/v1/responses")
    assert "/v1/responses takes no images; send them to /v1/chat/completions" in error.message


@pytest.mark.parametrize(
    "url, reason",
    [
        ("https://example.com/cat.png", "must be a base64 data URL"),  # the server fetches nothing for a client
        ("file:///etc/passwd", "must be a base64 data URL"),
        ("data:image/svg+xml;base64,PHN2Zz4=", "must be a base64 data URL"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a readable image"),
    ],
)
def test_anything_but_an_inline_image_is_refused(url, reason):
    assert reason in _refused(_chat(url)).message


def test_an_image_claiming_too_many_pixels_is_refused_before_it_is_decoded():
    error = _refused(_chat(_data_url(size=(5000, 4000))))
    assert "5000 x 4000 pixels" in error.message


def test_at_most_max_images_per_request():
    checked_fields(_chat(*[_data_url()] * MAX_IMAGES), "/v1/chat/completions", 16, images=True)
    assert f"at most {MAX_IMAGES}" in _refused(_chat(*[_data_url()] * (MAX_IMAGES + 1))).message
