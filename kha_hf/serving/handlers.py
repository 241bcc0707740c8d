"""transformers' request handlers (chat, completions, responses) with what `kha serve` checks against the model.

transformers 5.24's handlers render the chat template and tokenise the prompt inside their async `handle_request`,
on the server's event loop: a slow render stalls every client, `/health` included. The subclasses here do, per
request (the body has already passed the guard's allowlist, `fields.py`):

- render and tokenise on a small thread pool, under the request's time limit (`--request-timeout`; what the
  render took is taken off the generation's budget); a prompt that does not render (the model's template refuses
  the messages) answers 400, as does an empty completion prompt on a tokenizer without a BOS token;
- `logit_bias` token ids must exist in the model's vocabulary;
- `temperature > 0` (or a `top_p`) samples, whatever the model's generation config says (transformers alone would
  stay greedy when the model's config does, silently ignoring the request's temperature);
- under continuous batching, every request is sampled with the server's settings (`generation.py`), so a
  per-request setting that would differ from them (temperature, top_p, frequency_penalty, logit_bias, stop, a seed
  while sampling) answers 400 naming the field, instead of being ignored or leaking into other clients' requests.

`kha serve` swaps these in for transformers' classes while its server is being built (as `server.py` does for
the model manager and the generation state).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .errors import RequestError
from .guard import RequestRegistry, ServeLimits

RENDER_THREADS = 2


def effective_sampling(config) -> dict:
    """The sampling settings CONFIG stands for (transformers 5.x leaves unset fields None: their defaults here)."""
    return {
        "do_sample": bool(config.do_sample),
        "temperature": 1.0 if config.temperature is None else config.temperature,
        "top_p": 1.0 if config.top_p is None else config.top_p,
        "repetition_penalty": 1.0 if config.repetition_penalty is None else config.repetition_penalty,
        "sequence_bias": config.sequence_bias or None,
    }


def check_model_settings(body: dict, model, gen_config, gen_manager, use_cb: bool) -> None:
    """RequestError (400) for settings this model or continuous batching cannot honour (see the module doc)."""
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    for key in body.get("logit_bias") or {}:
        if isinstance(vocab, int) and not int(key) < vocab:
            raise RequestError(400, f"logit_bias names token {key}; this model's vocabulary has {vocab}", "logit_bias")
    samples = (body.get("temperature") or 0) > 0 or body.get("top_p") is not None
    if samples and body.get("temperature") != 0:
        gen_config.do_sample = True
    if not use_cb:
        return
    server = gen_manager.sampling_config(model)
    ours, theirs = effective_sampling(gen_config), effective_sampling(server)
    mode_differs = ours["do_sample"] != theirs["do_sample"]  # named after the field that asked for it
    differs = {
        "temperature": mode_differs or (theirs["do_sample"] and ours["temperature"] != theirs["temperature"]),
        "top_p": mode_differs or (theirs["do_sample"] and ours["top_p"] != theirs["top_p"]),
        "frequency_penalty": ours["repetition_penalty"] != theirs["repetition_penalty"],
        "logit_bias": ours["sequence_bias"] != theirs["sequence_bias"],
        "stop": body.get("stop") is not None,  # continuous batching applies no stop strings
        "seed": theirs["do_sample"] and body.get("seed") is not None,  # one random generator for every request
    }
    for name, differ in differs.items():
        if differ and name in body:
            mode = "samples" if theirs["do_sample"] else "decodes greedily"
            raise RequestError(
                400,
                f"{name} is not accepted with --continuous-batching: every request shares the server's sampling "
                f"settings (this server {mode}, from the model's generation config), and a per-request {name} "
                "cannot be kept to its own request",
                name,
            )


def kha_handler_classes(limits: ServeLimits, registry: RequestRegistry) -> dict[str, type]:
    """transformers' handler classes, by name, with the checks of the module doc."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler
    from transformers.tokenization_utils_base import BatchEncoding

    pool = ThreadPoolExecutor(max_workers=RENDER_THREADS, thread_name_prefix="kha-serve-render")

    async def off_loop(render: Callable, started: float, param: str):
        """RENDER() on the render pool, within what is left of the request's time limit."""
        left = limits.request_timeout - (time.monotonic() - started)
        future = asyncio.get_running_loop().run_in_executor(pool, registry.track(render))
        try:
            return await asyncio.wait_for(future, timeout=max(left, 0.0))
        except asyncio.TimeoutError:
            raise RequestError(
                408, f"the prompt did not render within --request-timeout ({limits.request_timeout:g} s)", param
            ) from None

    def rendered(render: Callable, param: str) -> Callable:
        def run():
            try:
                return render()
            except RequestError:
                raise
            except Exception as err:  # the model's template (or tokenizer) refused what the client sent
                message = f"{type(err).__name__}: {err}"[:300]
                raise RequestError(400, f"the prompt could not be rendered: {message}", param) from None

        return run

    def budget(gen_config, started: float) -> None:
        gen_config.max_time = max(0.0, limits.request_timeout - (time.monotonic() - started))  # generation.py

    class Common:
        def _prepare(self, body: dict):
            self._validate_request(body)
            model_id, model, processor = self._resolve_model(body)
            modality = self.model_manager.get_model_modality(model, processor=processor)
            use_cb = self.generation_state.use_continuous_batching(model, modality)
            gen_manager = self.generation_state.get_manager(model_id, use_cb=use_cb)
            return model_id, model, processor, modality, use_cb, gen_manager

        async def _configure(self, body, model, gen_manager, use_cb, started):
            gen_config = self._build_generation_config(body, model.generation_config, use_cb=use_cb)
            check_model_settings(body, model, gen_config, gen_manager, use_cb)
            if use_cb:
                gen_manager.init_cb(model, gen_config)
                if gen_manager.cache_tokens is None:  # the first request: the batch loop builds its cache
                    await asyncio.get_running_loop().run_in_executor(pool, gen_manager.wait_for_cache)
            budget(gen_config, started)
            return gen_config

        async def _render_chat(self, processor, messages, tools, use_cb, model, started, param):
            def render():
                return processor.apply_chat_template(
                    messages,
                    add_generation_prompt=True,
                    tools=tools,
                    return_tensors=None if use_cb else "pt",
                    return_dict=True,
                    tokenize=True,
                    load_audio_from_video=False,  # text parts only (fields.py)
                    **self.chat_template_kwargs,  # the server's own (kha serve sets none), never a client's
                )

            inputs = await off_loop(rendered(render, param), started, param)
            return inputs if use_cb else inputs.to(model.device)

    class KHAChatCompletionHandler(Common, ChatCompletionHandler):
        async def handle_request(self, body: dict, request_id: str):
            # As transformers 5.24's ChatCompletionHandler.handle_request, with the template rendered off the
            # event loop, the server's chat_template_kwargs only, and the checks of check_model_settings.
            started = time.monotonic()
            model_id, model, processor, modality, use_cb, gen_manager = self._prepare(body)
            messages = self.get_processor_inputs_from_messages(body["messages"], modality)
            tools = body.get("tools")
            inputs = await self._render_chat(processor, messages, tools, use_cb, model, started, "messages")
            gen_config = await self._configure(body, model, gen_manager, use_cb, started)
            args = (request_id, model, processor, model_id, inputs, gen_config)
            if body.get("stream"):
                return self._streaming(*args, gen_manager=gen_manager, tools=tools)
            return await self._non_streaming(*args, gen_manager=gen_manager, tools=tools)

    class KHACompletionHandler(Common, CompletionHandler):
        async def handle_request(self, body: dict, request_id: str):
            # As transformers 5.24's CompletionHandler.handle_request, with the prompt tokenised off the event
            # loop; an empty prompt starts from the BOS token (transformers 5.24 fails on it with a 500).
            started = time.monotonic()
            model_id, model, processor, _, use_cb, gen_manager = self._prepare(body)
            tokenizer = getattr(processor, "tokenizer", processor)

            def tokenize():
                encoded = dict(tokenizer(body["prompt"], return_tensors=None))
                if not encoded["input_ids"]:
                    if tokenizer.bos_token_id is None:
                        raise RequestError(
                            400, "prompt is empty and this model has no BOS token to start from", "prompt"
                        )
                    encoded = {"input_ids": [tokenizer.bos_token_id], "attention_mask": [1]}
                if use_cb:
                    return encoded
                return BatchEncoding({k: [v] for k, v in encoded.items()}, tensor_type="pt").to(model.device)

            inputs = await off_loop(rendered(tokenize, "prompt"), started, "prompt")
            gen_config = await self._configure(body, model, gen_manager, use_cb, started)
            args = (request_id, model, processor, model_id, inputs, gen_config, gen_manager, body.get("suffix"))
            if body.get("stream"):
                return self._streaming(*args)
            return await self._non_streaming(*args)

    class KHAResponseHandler(Common, ResponseHandler):
        async def handle_request(self, body: dict, request_id: str):
            # As transformers 5.24's ResponseHandler.handle_request, with the template rendered off the event
            # loop and the server's chat_template_kwargs only.
            started = time.monotonic()
            model_id, model, processor, modality, use_cb, gen_manager = self._prepare(body)
            messages = self.get_processor_inputs_from_messages(self._normalize_input(body), modality)
            tools = self._normalize_tools(body.get("tools"))
            inputs = await self._render_chat(processor, messages, tools, use_cb, model, started, "input")
            gen_config = await self._configure(body, model, gen_manager, use_cb, started)
            args = (request_id, model, processor, model_id, body, inputs, gen_config)
            if body.get("stream", True):
                return self._streaming(*args, gen_manager=gen_manager, tools=tools)
            return await self._non_streaming(*args, gen_manager=gen_manager, tools=tools)

    return {
        "ChatCompletionHandler": KHAChatCompletionHandler,
        "CompletionHandler": KHACompletionHandler,
        "ResponseHandler": KHAResponseHandler,
    }
