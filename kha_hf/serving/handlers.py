"""transformers' request handlers (chat, completions, responses) with what `kha serve` checks against the model.

The subclasses here keep transformers' response builders (`_streaming`, `_non_streaming`: SSE events, tool calls,
reasoning) and replace `handle_request`, which does, per request (the body has already passed the guard's
allowlist, `fields.py`):

- render and tokenise in a render worker process (`render_pool`, which says why): at most RENDER_WORKERS at once,
  under the request's time limit (`--request-timeout`; what the render took is taken off the generation's budget)
  and a memory cap (`--render-memory`). transformers 5.25 renders on one thread for all requests, without a time
  limit: a slow render held up every other request's prompt, an endless one every later request. The call rendered
  is the one 5.25's own `render_messages` builds (`recording`). A prompt that does not render answers 400, as does
  an empty completion prompt on a tokenizer without a BOS token (`KHACompletionHandler`);
- `logit_bias` token ids must exist in the model's vocabulary;
- `temperature > 0` (or a `top_p`) samples, whatever the model's generation config says (5.25 alone stays greedy
  when the model's config does, silently ignoring the request's temperature);
- under continuous batching, each request keeps its own temperature and top_p (5.25 lets a request set them for
  itself, and kha serve creates the batch so that it can: `engine.prepare_for_continuous_batching`); what the batch
  applies to every request alike (frequency_penalty, logit_bias, stop strings: none, the random generator: a seed
  while sampling) answers 400 naming the field when a request asks for something else, instead of being ignored
  or leaking into other clients' requests;
- the prompt and the new tokens are fitted to the context (and the paged cache), and the generation runs under the
  request's time limit, through `generation.Generation`.

`app.KHAServe` builds these in place of transformers' classes.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.utils import prompt_length

from .engine import SEED_KWARG
from .errors import RequestError
from .generation import Generation, fit_request
from .guard import RequestRegistry, ServeLimits
from .render_pool import RenderFailed, RenderPool, RenderTimedOut

ASKED_TOKENS = ("max_completion_tokens", "max_tokens", "max_output_tokens")  # chat's first one wins, as in 5.25
PER_REQUEST_SAMPLING = ("temperature", "top_k", "top_p")  # what continuous batching takes per request (5.25)


def refuse_under_cb(name: str, reason: str) -> RequestError:
    return RequestError(
        400,
        f"{name} is not accepted with --continuous-batching: {reason}, so a per-request {name} cannot be kept to "
        "its own request",
        name,
    )


def check_model_settings(body: dict, vocab: int | None, generation_kwargs: dict) -> None:
    """RequestError (400) for settings a model of VOCAB tokens cannot honour; `temperature > 0` or a `top_p` samples."""
    for key in body.get("logit_bias") or {}:
        if isinstance(vocab, int) and not int(key) < vocab:
            raise RequestError(400, f"logit_bias names token {key}; this model's vocabulary has {vocab}", "logit_bias")
    if ((body.get("temperature") or 0) > 0 or body.get("top_p") is not None) and body.get("temperature") != 0:
        generation_kwargs["do_sample"] = True


# the processor's (or tokenizer's) attributes that name the tokens it writes for an image (or a video, audio): Gemma 3's
# image_token <image_soft_token>, boi_token <start_of_image>, eoi_token <end_of_image>, and the like of other models
MEDIA_TOKEN_ATTRIBUTES = (
    "image_token", "boi_token", "eoi_token", "start_image_token", "end_image_token", "image_start_token",
    "image_end_token", "fake_image_token", "global_image_token", "video_token", "audio_token", "boa_token",
    "eoa_token",
)  # fmt: skip


def media_tokens(processor) -> set[str]:
    """The special tokens PROCESSOR writes for an image (or video, audio) part, from it and its tokenizer."""
    found = set()
    for owner in (processor, getattr(processor, "tokenizer", None)):
        for name in MEDIA_TOKEN_ATTRIBUTES:
            try:
                value = getattr(owner, name, None)
            except Exception:  # a tokenizer's attribute may raise when it is unset
                continue
            if isinstance(value, str) and value.strip():
                found.add(value)
    return found


def message_texts(messages) -> list[tuple[str, str]]:
    """(where, text) of every text a client sent in MESSAGES (chat messages or Responses input items)."""
    if isinstance(messages, str):
        return [("text", messages)]
    texts = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append((f"messages[{i}].content", content))
        elif isinstance(content, list):
            for j, part in enumerate(content):
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    texts.append((f"messages[{i}].content[{j}].text", text))
    return texts


def check_no_media_tokens(processor, messages, param: str) -> None:
    """RequestError (400) naming the token when a client's text holds one of the tokens the processor writes for an
    image: typed beside an image it breaks the count of images against features (the model raised: a 500), typed
    alone it is fed as an image placeholder without features."""
    tokens = media_tokens(processor)
    if not tokens:
        return
    for where, text in message_texts(messages):
        for token in sorted(tokens):
            if token in text:
                raise RequestError(
                    400,
                    f"{where} holds {token!r}, a token this model's processor writes for an image: send images as "
                    "image_url parts, not their tokens",
                    param,
                )


def recording(engine) -> SimpleNamespace:
    """ENGINE as transformers' own `render_messages` reads it, with a stand-in processor: its `apply_chat_template`
    call (messages, tools, template keywords, as 5.25 builds them) is recorded for a render worker instead of run."""
    processor = SimpleNamespace(apply_chat_template=lambda *args, **kwargs: ("chat", args, kwargs))
    return SimpleNamespace(processor=processor, modality=engine.modality, use_cb=engine.use_cb)


def check_continuous_batching(body: dict, vocab: int | None, model_generation, generation_kwargs: dict, info) -> None:
    """Under continuous batching: RequestError (400) for what the batch applies to every request alike, when this
    request asks for something else; a sampling request gets all its per-request settings (INFO: what the batch
    takes per request, `engine.engine_cb_info`), a greedy one loses its seed (nothing random is drawn for it).
    MODEL_GENERATION: the model's generation config (what the batch applies)."""
    penalty = model_generation.repetition_penalty
    model_penalty = 1.0 if penalty is None else penalty
    if generation_kwargs.get("repetition_penalty", model_penalty) != model_penalty and "frequency_penalty" in body:
        raise refuse_under_cb("frequency_penalty", "the batch applies the model's repetition penalty to every request")
    model_bias = model_generation.sequence_bias or None
    if (generation_kwargs.get("sequence_bias") or None) != model_bias and "logit_bias" in body:
        raise refuse_under_cb("logit_bias", "the batch applies the model's logit bias (if any) to every request")
    if body.get("stop") is not None:
        raise refuse_under_cb("stop", "the batch applies no stop strings")
    if not generation_kwargs.get("do_sample") or generation_kwargs.get("temperature") == 0:  # greedy (CBGenerateRunner)
        generation_kwargs.pop("seed", None)  # transformers would reseed every request's random numbers with it
        return
    if "seed" in body:
        raise refuse_under_cb("seed", "the batch draws every sampling request's random numbers from one generator")
    missing = [name for name in PER_REQUEST_SAMPLING if name not in (info.get("per_request") or ())]
    if missing:
        name = next((field for field in ("temperature", "top_p") if field in body), "temperature")
        raise refuse_under_cb(name, f"this batch cannot set {', '.join(missing)} per request")
    # every setting sent, so that none falls back to the values the batch was created with
    temperature, top_p, top_k = (generation_kwargs.get(name) for name in ("temperature", "top_p", "top_k"))
    generation_kwargs["temperature"] = 1.0 if temperature is None else float(temperature)
    generation_kwargs["top_p"] = 1.0 if top_p is None else float(top_p)
    generation_kwargs["top_k"] = int(top_k) if top_k else int(vocab) if isinstance(vocab, int) else 1 << 30


class KHAHandler:
    """What kha serve's handlers add to transformers' (first among their bases): RENDERS, the server's render workers
    (one pool: kha serve serves one model), LIMITS, the requests in flight in REGISTRY. Each endpoint's subclass
    renders its prompt (`_inputs`)."""

    INPUT = "messages"  # the request field that holds its prompt (each endpoint names its own)

    def __init__(self, *args, renders: RenderPool, limits: ServeLimits, registry: RequestRegistry, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renders, self.limits, self.registry = renders, limits, registry

    async def _rendered(self, job: tuple, started: float, param: str):
        """JOB ((kind, args, kwargs): a chat template's render or a completion's tokenisation) run in a render worker,
        within what is left of the request's time limit, counted in /health as work in flight; a failure is a 400, a
        render past the limit (whose worker is ended) a 408."""
        limits, key = self.limits, object()
        self.registry.begin(key)
        try:
            return await self.renders.run(*job, timeout=started + limits.request_timeout - time.monotonic())
        except RenderTimedOut:
            raise RequestError(
                408, f"the prompt did not render within --request-timeout ({limits.request_timeout:g} s)", param
            ) from None
        except RenderFailed as err:
            raise RequestError(400, f"the prompt could not be rendered: {err}", param) from None
        finally:
            self.registry.end(key)

    async def handle_request(self, body: dict, request_id: str):
        # As transformers 5.25's handle_request of each endpoint, with the prompt rendered on kha serve's pool under
        # the time limit (`_inputs`), and kha serve's checks and limits
        started = time.monotonic()
        self._validate_request(body)
        engine = self.model_manager.get_engine(body.get("model"))
        inputs = await self._inputs(body, engine, started)
        if prompt_length(inputs) == 0:  # transformers 5.25 answered a 500 ("cannot reshape tensor of 0 elements")
            message = "the model's chat template renders this request to no tokens: nothing to generate from"
            raise RequestError(400, message, self.INPUT)
        generation_kwargs = self._build_generation_kwargs(body, engine.generation_config)
        vocab = getattr(engine.model_config.get_text_config(), "vocab_size", None)
        check_model_settings(body, vocab, generation_kwargs)
        cache_tokens = None
        if engine.use_cb:
            info = await engine.cb_info()
            check_continuous_batching(body, vocab, engine.generation_config, generation_kwargs, info)
            cache_tokens = info.get("cache_tokens")
        elif generation_kwargs.get("seed") is not None:
            # applied in the model's process to this request's generation only (engine.generation_isolated)
            generation_kwargs[SEED_KWARG] = int(generation_kwargs.pop("seed"))
        asked = next((body[key] for key in ASKED_TOKENS if body.get(key) is not None), None)
        fit_request(engine.model_config, prompt_length(inputs), asked, generation_kwargs, self.limits, cache_tokens)
        self._log_request(request_id, engine, inputs, generation_kwargs, body.get("stream"), body)
        bound = Generation(engine, request_id, started + self.limits.request_timeout, self.registry)
        return await self._answer(body, request_id, bound, inputs, generation_kwargs)

    async def _answer(self, body: dict, request_id: str, engine, inputs, generation_kwargs: dict):
        """As 5.25's chat and completion handlers answer: their response builders get the request's tools (chat) or
        suffix (completions), named by EXTRA."""
        args = (request_id, engine, inputs, generation_kwargs, body.get(self.EXTRA))
        if body.get("stream"):
            return self._streaming(*args, body.get("stream_options"))
        return await self._non_streaming(*args)


class KHAChatCompletionHandler(KHAHandler, ChatCompletionHandler):
    EXTRA = "tools"
    INPUT = "messages"

    async def _inputs(self, body: dict, engine, started: float):
        check_no_media_tokens(engine.processor, body["messages"], "messages")
        job = self.render_messages(recording(engine), body["messages"], body)
        return await self._rendered(job, started, "messages")


class KHACompletionHandler(KHAHandler, CompletionHandler):
    EXTRA = "suffix"
    INPUT = "prompt"

    async def _inputs(self, body: dict, engine, started: float):
        # the prompt tokenised on kha serve's pool; an empty prompt starts from the BOS token (5.25 would send the
        # model an empty prompt)
        tokenizer = getattr(engine.processor, "tokenizer", engine.processor)
        encoded = await self._rendered(("tokenize", (body["prompt"],), {}), started, "prompt")
        encoded = {name: encoded[name] for name in ("input_ids", "attention_mask") if name in encoded}
        if not encoded["input_ids"]:
            if tokenizer.bos_token_id is None:
                raise RequestError(400, "prompt is empty and this model has no BOS token to start from", "prompt")
            encoded = {"input_ids": [tokenizer.bos_token_id], "attention_mask": [1]}
        return encoded if engine.use_cb else {k: torch.tensor([v]) for k, v in encoded.items()}


class KHAResponseHandler(KHAHandler, ResponseHandler):
    INPUT = "input"

    async def _inputs(self, body: dict, engine, started: float):
        check_no_media_tokens(engine.processor, body["input"], "input")
        check_no_media_tokens(engine.processor, body.get("instructions"), "instructions")
        job = self.render_messages(recording(engine), self._normalize_input(body), body)
        return await self._rendered(job, started, "input")

    async def _answer(self, body: dict, request_id: str, engine, inputs, generation_kwargs: dict):
        args = (request_id, engine, body, inputs, generation_kwargs)  # as 5.25's ResponseHandler answers
        return self._streaming(*args) if body.get("stream") else await self._non_streaming(*args)
