"""What a request to `kha serve` may carry: one allowlist per endpoint, every field with its type and range.

A field that is not listed for its endpoint answers 400 naming it, and so does a listed field of the wrong type
or out of range, at any depth (`messages[2].content[0].text`). The lists hold what transformers' handlers (5.25)
apply, so nothing a client sends is silently ignored; the ranges keep every value inside what transformers
accepts without an exception (a 500), and keep the work a request can ask for small:

- `stop`: at most MAX_STOP_STRINGS strings of 1..MAX_STOP_CHARS characters (transformers builds
  `StopStringCriteria` over vocabulary x stop strings before the first token, where no time limit runs);
- `logit_bias`: at most MAX_LOGIT_BIAS entries, keys token ids written in decimal, values in [-100, 100] (sent on
  as floats: an integer bias reaches `SequenceBiasLogitsProcessor`, which demands floats); token ids are checked
  against the model's vocabulary where the model is known (`handlers.py`);
- no field may nest deeper than MAX_DEPTH levels, numbers must be finite;
- `chat_template_kwargs` and `generation_config` are not accepted: the first reaches `apply_chat_template` (a
  client's own template, or `padding="max_length"` with any `max_length`), the second bypasses every limit.

Values are normalised on the way (a `null` optional field is dropped, `stop: []` means no stop strings, integer
biases become floats), and the body passed on to transformers is the one checked here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

from .errors import RequestError

MAX_DEPTH = 32  # nesting levels of the whole body (a tool's JSON schema included)
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 64
MAX_LOGIT_BIAS = 300
MAX_MESSAGES = 1024
MAX_TOOLS = 64
MAX_SEED = 2**64 - 1  # torch.manual_seed's largest
MIN_TEMPERATURE = 0.01
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_IMAGES = 8  # image parts per request (multimodal models only)
MAX_IMAGE_PIXELS = 4096 * 4096  # a decoded image's size: a few-KB PNG can claim gigapixels
IMAGE_DATA_URL = re.compile(r"^data:image/(png|jpeg|jpg|webp|gif);base64,([A-Za-z0-9+/=\s]+)$")
TEXT_PARTS = {"/v1/chat/completions": ("text",), "/v1/responses": ("input_text", "output_text")}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REFUSED = {
    "chat_template_kwargs": "chat_template_kwargs is not accepted by kha serve: prompts are rendered with the "
    "model's own chat template",
    "generation_config": "generation_config is not accepted by kha serve: use max_tokens, temperature, top_p, seed",
}

Check = Callable[[object, str], object]  # (value, the field's name) -> the value to pass on; RequestError if bad


def bad(name: str, must: str, value) -> RequestError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return RequestError(400, f"{name} must be {must}, got {shown}", name)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    # an int is finite however large (math.isfinite raises OverflowError past a float's range: a 500 once)
    return is_int(value) or (isinstance(value, float) and math.isfinite(value))


def boolean(value, name):
    if not isinstance(value, bool):
        raise bad(name, "true or false", value)
    return value


def integer(low: int, high: int, note: str = "") -> Check:
    def check(value, name):
        if not is_int(value) or not low <= value <= high:
            raise bad(name, f"an integer from {low} to {high}{note}", value)
        return value

    return check


def number(low: float, high: float, low_open: bool = False) -> Check:
    bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"

    def check(value, name):
        if not is_number(value) or not (value > low if low_open else value >= low) or value > high:
            raise bad(name, f"a number in {bound}", value)
        return value

    return check


def string(max_chars: int | None = None, min_chars: int = 0) -> Check:
    def check(value, name):
        if not isinstance(value, str):
            raise bad(name, "a string", value)
        if len(value) < min_chars or (max_chars is not None and len(value) > max_chars):
            raise bad(name, f"a string of {min_chars} to {max_chars} characters", value)
        return value

    return check


def one_of(*allowed) -> Check:
    def check(value, name):
        if isinstance(value, bool) or value not in allowed:
            raise bad(name, " or ".join(repr(a) for a in allowed), value)
        return value

    return check


def temperature(value, name):
    """A temperature in [0, 2]; below MIN_TEMPERATURE it decodes greedily (its limit): transformers would divide
    the logits by it and overflow them to inf (NaN probabilities, a 500)."""
    number(0.0, 2.0)(value, name)
    return 0 if value < MIN_TEMPERATURE else value


def json_object(value, name):
    if not isinstance(value, dict) or not all(isinstance(key, str) for key in value):
        raise bad(name, "a JSON object", value)
    return value


def stop(value, name):
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or len(strings) > MAX_STOP_STRINGS:
        raise bad(name, f"a string or a list of at most {MAX_STOP_STRINGS} strings", value)
    for i, item in enumerate(strings):
        string(MAX_STOP_CHARS, 1)(item, f"{name}[{i}]" if isinstance(value, list) else name)
    return strings or None  # an empty list: no stop strings


def logit_bias(value, name):
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise bad(name, f"an object of at most {MAX_LOGIT_BIAS} token ids", value)
    biases = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad(name, "an object whose keys are token ids", key)
        number(-100, 100)(bias, f"{name}[{key}]")
        biases[str(int(key))] = float(bias)  # SequenceBiasLogitsProcessor takes floats only (5.24, 5.25)
    return biases or None  # transformers fails on an empty sequence_bias (5.24, 5.25)


def fields_of(spec: dict[str, Check], required: tuple[str, ...] = ()) -> Check:
    """An object holding only SPEC's keys (REQUIRED among them), each checked by its Check."""

    def check(value, name):
        if not isinstance(value, dict):
            raise bad(name, f"an object with fields {', '.join(spec)}", value)
        out = {}
        for key, item in value.items():
            if key not in spec:
                raise RequestError(400, f"{name}.{key} is not accepted (accepted: {', '.join(spec)})", f"{name}.{key}")
            if item is not None:
                out[key] = spec[key](item, f"{name}.{key}")
        for key in required:
            if out.get(key) is None:
                raise RequestError(400, f"{name}.{key} is required", f"{name}.{key}")
        return out

    return check


def list_of(item_check: Check, max_items: int, min_items: int = 0) -> Check:
    def check(value, name):
        if not isinstance(value, list) or not min_items <= len(value) <= max_items:
            raise bad(name, f"a list of {min_items} to {max_items} items", value)
        return [item_check(item, f"{name}[{i}]") for i, item in enumerate(value)]

    return check


def arguments(value, name):
    """A tool call's arguments: a JSON object, or its text (transformers parses the text into the object)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            raise bad(name, "a JSON object or its text", value) from None
        check_structure(parsed, name)
        json_object(parsed, name)
        return value
    return json_object(value, name)


def image_url(value, name):
    """An image given inline as a base64 data URL (png, jpeg, webp, gif) of at most MAX_IMAGE_PIXELS. The server
    fetches nothing for a client: an http(s) URL would have it read any address it can reach."""
    import base64
    import binascii
    import io

    from PIL import Image

    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str) or set(value) - {"url", "detail"}:
        raise bad(name, "{url: 'data:image/png;base64,...'}", value)
    match = IMAGE_DATA_URL.match(url)
    if match is None:
        raise RequestError(
            400,
            f"{name}.url must be a base64 data URL of a png, jpeg, webp or gif image (kha "
            "serve fetches no URL for a client)",
            name,
        )
    try:
        with Image.open(io.BytesIO(base64.b64decode(match.group(2), validate=False))) as image:
            width, height = image.size  # the header only: nothing is decoded yet
    except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as err:
        raise RequestError(400, f"{name}.url is not a readable image: {err}", name) from err
    if width * height > MAX_IMAGE_PIXELS:
        raise RequestError(
            400, f"{name} is {width} x {height} pixels; kha serve takes at most {MAX_IMAGE_PIXELS:,}", name
        )
    return {"url": url}


# kha serve passes images on in chat messages only (tests/serving/test_serve_multimodal.py checks that route)
RESPONSES_NO_IMAGES = "/v1/responses takes no images; send them to /v1/chat/completions"


def content(
    parts: tuple[str, ...], images: bool = False, no_images: str = "this model takes no images (a text model)"
) -> Check:
    """Message content: a string, or a list of text parts; IMAGES: image_url parts too (a multimodal model).
    NO_IMAGES: why an image part is refused otherwise."""
    text_part = fields_of({"type": one_of(*parts), "text": string()}, required=("type", "text"))
    image_part = fields_of({"type": one_of("image_url"), "image_url": image_url}, required=("type", "image_url"))
    kinds = "|".join((*parts, "image_url") if images else parts)

    def part(value, name):
        if images and isinstance(value, dict) and value.get("type") == "image_url":
            return image_part(value, name)
        if not images and isinstance(value, dict) and value.get("type") in ("image_url", "input_image"):
            raise RequestError(400, f"{name}: {no_images}", name)  # chat's image part, or the Responses API's
        return text_part(value, name)

    def check(value, name):
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise bad(name, f"a string or a list of {{type: {kinds}, ...}} parts", value)
        return list_of(part, MAX_MESSAGES)(value, name)

    return check


def function_name(value, name):
    if not isinstance(value, str) or not TOOL_NAME.match(value):
        raise bad(name, "a function name of 1 to 64 letters, digits, _ . -", value)
    return value


FUNCTION_FIELDS = {"name": function_name, "description": string(), "parameters": json_object, "strict": boolean}
CHAT_TOOL = fields_of(
    {"type": one_of("function"), "function": fields_of(FUNCTION_FIELDS, required=("name",))},
    required=("type", "function"),
)
# the Responses API's flat form ({type, name, parameters...}); transformers nests it for the template
RESPONSE_TOOL = fields_of({"type": one_of("function"), **FUNCTION_FIELDS}, required=("type", "name"))
TOOL_CALL = fields_of(
    {
        "id": string(256),
        "type": one_of("function"),
        "function": fields_of({"name": string(64, 1), "arguments": arguments}, required=("name", "arguments")),
    },
    required=("function",),
)


def chat_messages(images: bool) -> Check:
    """The messages of a chat request; with IMAGES, image parts too (at most MAX_IMAGES in all)."""
    message = fields_of(
        {
            "role": one_of(*CHAT_ROLES),
            "content": content(TEXT_PARTS["/v1/chat/completions"], images),
            "tool_calls": list_of(TOOL_CALL, MAX_TOOLS),
            "tool_call_id": string(256),
        },
        required=("role",),
    )
    messages = list_of(message, MAX_MESSAGES, min_items=1)

    def check(value, name):
        # counted before any part is checked: each image's check decodes its base64 and opens it (6,000 one-pixel
        # PNGs in one body kept the event loop busy before the cap refused them)
        count = sum(
            1
            for message in (value if isinstance(value, list) else ())
            if isinstance(message, dict) and isinstance(message.get("content"), list)
            for part in message["content"]
            if isinstance(part, dict) and part.get("type") == "image_url"
        )
        if count > MAX_IMAGES:
            raise RequestError(400, f"{name} holds {count} images; kha serve takes at most {MAX_IMAGES}", name)
        return messages(value, name)

    return check


RESPONSE_ITEMS = {  # /v1/responses input items, by type
    "message": fields_of(
        {
            "type": one_of("message"),
            "role": one_of(*CHAT_ROLES),
            "content": content(TEXT_PARTS["/v1/responses"], no_images=RESPONSES_NO_IMAGES),
        },
        required=("role", "content"),
    ),
    "function_call": fields_of(
        {
            "type": one_of("function_call"),
            "call_id": string(256),
            "name": string(64, 1),
            "arguments": arguments,
            "id": string(256),
            "status": string(32),
        },
        required=("type", "call_id", "name", "arguments"),
    ),
    "function_call_output": fields_of(
        {"type": one_of("function_call_output"), "call_id": string(256), "output": string(), "id": string(256)},
        required=("type", "call_id", "output"),
    ),
}


def response_input(value, name):
    """`input` of /v1/responses: a string, a list of text parts (one user message), or a list of items."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_MESSAGES:
        raise bad(name, f"a string or a list of 1 to {MAX_MESSAGES} input items", value)
    if isinstance(value[0], dict) and "role" not in value[0]:  # transformers (5.24, 5.25): a list of parts, one message
        return content(TEXT_PARTS["/v1/responses"], no_images=RESPONSES_NO_IMAGES)(value, name)
    out = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if not isinstance(kind, str) or kind not in RESPONSE_ITEMS or (kind == "message" and "role" not in item):
            raise bad(f"{name}[{i}]", "a message {role, content}, a function_call or a function_call_output", item)
        out.append(RESPONSE_ITEMS[kind](item, f"{name}[{i}]"))
    return out


def endpoint_fields(max_new_tokens: int, images: bool = False) -> dict[str, tuple[dict[str, Check], tuple[str, ...]]]:
    """Per endpoint: the accepted fields with their checks, and the required ones (IMAGES: chat messages may hold
    image parts, for a multimodal model)."""
    new_tokens = integer(1, max_new_tokens, " (this server's --max-new-tokens)")
    sampling = {
        "model": string(),  # matched against the served model by the guard
        "stream": boolean,
        "temperature": temperature,
        "top_p": number(0.0, 1.0, low_open=True),
        "seed": integer(0, MAX_SEED),
        "user": string(256),  # the end user's id (OpenAI): informational
    }
    # frequency_penalty becomes transformers' repetition_penalty = 1 + frequency_penalty, which must be > 0 and
    # divides positive logits: at least 0.1, so that they cannot overflow
    penalty = number(-0.9, 2.0)
    # a last streamed chunk with the usage (transformers >= 5.25, as OpenAI; 5.24 sent it with every stream)
    stream_options = fields_of({"include_usage": boolean})
    return {
        "/v1/chat/completions": (
            {
                **sampling,
                "messages": chat_messages(images),
                "max_tokens": new_tokens,
                "max_completion_tokens": new_tokens,
                "frequency_penalty": penalty,
                "logit_bias": logit_bias,
                "stop": stop,
                "tools": list_of(CHAT_TOOL, MAX_TOOLS),
                "n": one_of(1),
                "stream_options": stream_options,
            },
            ("messages",),
        ),
        "/v1/completions": (
            {
                **sampling,
                "prompt": string(),
                "max_tokens": new_tokens,
                "frequency_penalty": penalty,
                "stop": stop,
                "suffix": string(),
                "n": one_of(1),
                "stream_options": stream_options,
            },
            ("prompt",),
        ),
        "/v1/responses": (
            {
                **sampling,
                "input": response_input,
                "instructions": string(),
                "max_output_tokens": new_tokens,
                "tools": list_of(RESPONSE_TOOL, MAX_TOOLS),
                "parallel_tool_calls": boolean,
            },
            ("input",),
        ),
    }


def check_structure(value, name: str) -> None:
    """RequestError (400) naming NAME when VALUE is unfit to pass on whatever its field: nesting past MAX_DEPTH, or
    a string that is not Unicode text (a lone surrogate such as "\\ud800", which JSON allows; transformers fails where
    it encodes it)."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, str) and not _is_text(item):
            raise RequestError(400, f"{name} holds a string that is not Unicode text (a lone surrogate)", name)
        if isinstance(item, (dict, list)):
            if level >= MAX_DEPTH:
                raise RequestError(400, f"{name} is nested more than {MAX_DEPTH} levels deep", name)
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def checked_fields(body: dict, path: str, max_new_tokens: int, images: bool = False) -> dict:
    """BODY (a parsed JSON object) with only the fields PATH accepts, each checked and normalised (IMAGES: image
    parts in chat messages are accepted)."""
    spec, required = endpoint_fields(max_new_tokens, images)[path]
    out = {}
    for key, value in body.items():
        if not _is_text(key):
            raise RequestError(400, "a field name is not Unicode text (a lone surrogate)")
        if key in REFUSED:
            raise RequestError(400, REFUSED[key], key)
        if key not in spec:
            raise RequestError(400, f"{key} is not accepted by {path} on kha serve (accepted: {', '.join(spec)})", key)
        check_structure(value, key)
        if value is not None:
            checked = spec[key](value, key)
            if checked is not None:
                out[key] = checked
    for key in required:
        if key not in out:
            raise RequestError(400, f"{key} is required", key)
    return out
