"""transformers' generation managers with the limits of `kha serve`: context, new tokens, time, disconnects.

transformers 5.24's `GenerateManager` runs `model.generate` on one inference thread per model, and
`CBGenerateManager` feeds its continuous-batching manager; neither caps a request by the model's context, a
non-streamed generation runs on after its client has gone, and continuous batching has no time limit at all (its
requests take no `max_time`) and takes its sampling settings from the first request it sees. The subclasses here
add, per request:

- the prompt must fit the model's context (`max_position_embeddings`), else 400; `max_new_tokens` is cut to the
  server's limit and to what the context leaves (the reply's finish_reason says "length");
- a time limit: the request's budget (`--request-timeout` less the time its prompt took to render), counted from
  its submission (time queued behind other requests included; a request whose time ran out before it reached the
  model answers 503), a stopping criterion on the sequential path, a timer that cancels the request under
  continuous batching; a generation cut by it ends with finish_reason "length" and the tokens made so far;
- cancellation when the client disconnects (`RequestRegistry.cancel`, called by the guard middleware);
- each generation is tracked while it runs, so `/health` can tell a stuck server (continuous batching included);
- continuous batching samples with the server's settings (the model's generation config), never with a request's:
  `handlers.py` refuses per-request settings that would differ from them.

`KHAGenerationState` hands out these managers; `kha serve` swaps it in for transformers' class while its server is
being built (the same one-call swap as the model manager's).
"""

from __future__ import annotations

import asyncio
import copy
import time

from .errors import RequestError
from .guard import RequestRegistry, ServeLimits

# transformers 5.24 keeps up to 8 StopStringCriteria embeddings (vocabulary x stop-string positions, ~100 MB each
# for a 49k vocabulary) in a module-level cache; kha serve keeps the 2 most recent
STOP_STRING_CACHE_ENTRIES = 2
CACHE_WHAT = "continuous batching's KV cache (--cb-num-blocks)"


def model_context(model) -> int | None:
    """The number of positions MODEL was built for, or None when its config does not say."""
    value = getattr(model.config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def fit_request(model, inputs: dict, gen_config, limits: ServeLimits, cache_tokens: int | None = None) -> None:
    """Cut GEN_CONFIG's new tokens to the limits; HTTP 400 when the prompt alone does not fit the context (or,
    under continuous batching, the CACHE_TOKENS its paged cache holds)."""
    ids = inputs["input_ids"]
    prompt = len(ids) if isinstance(ids, list) else int(ids.shape[-1])
    allowed = limits.max_new_tokens
    for context, what in ((model_context(model), "this model's context"), (cache_tokens, CACHE_WHAT)):
        if context is None:
            continue
        if prompt >= context:
            raise RequestError(400, f"the prompt has {prompt} tokens; {what} is {context} tokens")
        allowed = min(allowed, context - prompt)
    gen_config.max_new_tokens = min(gen_config.max_new_tokens or allowed, allowed)
    gen_config.max_length = None  # max_new_tokens decides


def take_budget(gen_config, limits: ServeLimits) -> float:
    """The seconds this request's generation may run (set as GEN_CONFIG.max_time by the handler), at most
    --request-timeout; max_time is cleared, as kha serve applies the limit itself (see `TimeLimit`)."""
    budget = gen_config.max_time if gen_config.max_time is not None else limits.request_timeout
    gen_config.max_time = None
    return max(0.0, min(budget, limits.request_timeout))


def mark_cut(gen_config, generated: int) -> None:
    """A generation stopped by its time limit after GENERATED tokens: transformers' handlers report "length"
    when the tokens reach max_new_tokens, so max_new_tokens (of this request's own copy) becomes GENERATED."""
    gen_config.max_new_tokens = generated


def trim_stop_string_cache() -> None:
    from transformers.generation import stopping_criteria

    cache = stopping_criteria.STOP_STRING_EMBEDDING_CACHE
    while len(cache) > STOP_STRING_CACHE_ENTRIES:
        cache.popitem(last=False)  # the least recently used


def time_limit_criterion(seconds: float, prompt_len: int, gen_config):
    """A stopping criterion: stop SECONDS after it is made, marking the cut on GEN_CONFIG (see `mark_cut`).
    transformers' own max_time stops as well, but the handlers cannot tell its stop from an end of text."""
    import torch
    from transformers.generation.stopping_criteria import StoppingCriteria

    class TimeLimit(StoppingCriteria):
        def __init__(self) -> None:
            self.deadline = time.monotonic() + seconds
            self.fired = False

        def __call__(self, input_ids, scores, **kwargs):
            over = time.monotonic() >= self.deadline
            if over and not self.fired:
                self.fired = True
                mark_cut(gen_config, int(input_ids.shape[-1]) - prompt_len)
            return torch.full((input_ids.shape[0],), over, dtype=torch.bool, device=input_ids.device)

    return TimeLimit()


class WaitedTooLong(Exception):
    """A request's time limit ran out while it waited for the inference thread (other requests ran first)."""

    MESSAGE = "the server was busy for this request's whole --request-timeout; retry later"


def timed_generate(model, kwargs: dict, gen_config, deadline: float):
    """model.generate(**KWARGS) stopped at DEADLINE (time.monotonic(), set when the request was submitted, so
    the time it waited behind other requests counts); WaitedTooLong if it has passed before generation starts."""
    from transformers.generation.stopping_criteria import StoppingCriteriaList

    budget = deadline - time.monotonic()
    if budget <= 0:
        raise WaitedTooLong(WaitedTooLong.MESSAGE)
    prompt_len = int(kwargs["input_ids"].shape[-1])
    limit = time_limit_criterion(budget, prompt_len, gen_config)
    try:
        return model.generate(**kwargs, stopping_criteria=StoppingCriteriaList([limit]))
    finally:
        trim_stop_string_cache()


def kha_generation_state_class(limits: ServeLimits, registry: RequestRegistry):
    """transformers' GenerationState, handing out managers that apply LIMITS and cancel through REGISTRY."""
    from transformers.cli.serving.utils import (
        CBGenerateManager,
        CBStreamer,
        CBWorkerDeadError,
        DirectStreamer,
        GenerateManager,
        GenerationState,
        _GenerationCancelled,
        _StreamError,
    )

    class CancellableStreamer:
        """The streamer protocol of `model.generate`, used only to stop a non-streamed generation: the next
        token after `cancel()` raises, as transformers' own DirectStreamer does for streamed requests."""

        def __init__(self) -> None:
            self.cancelled = False

        def put(self, value) -> None:
            if self.cancelled:
                raise _GenerationCancelled()

        def end(self) -> None:
            pass

        def cancel(self) -> None:
            self.cancelled = True

    class LimitedGenerateManager(GenerateManager):
        def submit(self, fn, *args, **kwargs):
            return super().submit(registry.track(fn), *args, **kwargs)

        def async_submit(self, fn, *args, **kwargs):
            return super().async_submit(registry.track(fn), *args, **kwargs)

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            # As transformers 5.24's GenerateManager.generate_streaming, plus the limits and cancellation.
            fit_request(model, inputs, gen_config, limits)
            deadline = time.monotonic() + take_budget(gen_config, limits)  # queued time counts
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
            streamer = DirectStreamer(rust_tokenizer, loop, queue, response_parser=response_parser)
            kwargs = {**inputs, "streamer": streamer, "generation_config": gen_config, "tokenizer": processor}
            if hasattr(model, "has_talker"):
                kwargs["generation_mode"] = "text"

            def run() -> None:
                try:
                    timed_generate(model, kwargs, gen_config, deadline)
                except _GenerationCancelled:
                    loop.call_soon_threadsafe(queue.put_nowait, None)
                except Exception as err:
                    loop.call_soon_threadsafe(queue.put_nowait, _StreamError(str(err)))

            self.submit(run)
            registry.on_cancel(request_id, streamer.cancel)
            return queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            # As transformers 5.24's GenerateManager.generate_non_streaming, plus the limits and a streamer that
            # stops the generation when the client disconnects.
            from fastapi import HTTPException

            fit_request(model, inputs, gen_config, limits)
            deadline = time.monotonic() + take_budget(gen_config, limits)  # queued time counts
            stopper = CancellableStreamer()
            registry.on_cancel(request_id, stopper.cancel)
            kwargs = {**inputs, "generation_config": gen_config, "tokenizer": processor, "streamer": stopper}
            if hasattr(model, "has_talker"):
                kwargs["generation_mode"] = "text"
            try:
                sequences = await self.async_submit(timed_generate, model, kwargs, gen_config, deadline)
            except _GenerationCancelled:
                raise HTTPException(status_code=499, detail="the client disconnected") from None
            except WaitedTooLong as err:
                raise RequestError(503, str(err)) from None
            input_len = inputs["input_ids"].shape[-1]
            generated_ids = sequences[0, input_len:]
            return processor.decode(generated_ids, skip_special_tokens=True), input_len, generated_ids

    class LimitedCBGenerateManager(CBGenerateManager):
        """Continuous batching with a time limit per request, /health tracking, and the server's sampling."""

        server_config = None

        def sampling_config(self, model):
            """The generation config every request is sampled with: the model's own (transformers 5.24 would take
            the first request's temperature, top_p, logit_bias... and apply them to every later request)."""
            if self.server_config is None:
                config = copy.deepcopy(model.generation_config)
                config.use_cache = False  # continuous batching manages its own paged cache
                config.max_new_tokens = limits.max_new_tokens
                self.server_config = config
            return self.server_config

        def init_cb(self, model, gen_config) -> None:
            super().init_cb(model, self.sampling_config(model))

        cache_tokens = None

        def wait_for_cache(self, seconds: float = 300) -> int | None:
            """The tokens continuous batching's paged cache holds, once its loop has built it (blocking: call it
            off the event loop). One request longer than that kills transformers 5.24's batch loop for every
            client ("No requests can be scheduled and no requests can be offloaded"): fit_request cuts to it."""
            deadline = time.monotonic() + seconds
            while self.cache_tokens is None and time.monotonic() < deadline and self.is_alive():
                processor = getattr(self._cb, "batch_processor", None)
                if processor is not None:
                    self.cache_tokens = int(processor.cache.max_tokens_read)
                else:
                    time.sleep(0.05)
            return self.cache_tokens

        def _forget(self, request_id: str) -> None:
            # a cancelled request is never finished, so transformers 5.24 never drops its result handler
            router = getattr(self._cb, "output_router", None)
            if router is not None:
                with router._lock:
                    router.result_handlers.pop(request_id, None)

        def _in_scheduler(self, request_id: str) -> bool:
            processor = getattr(self._cb, "batch_processor", None)
            scheduler = getattr(processor, "scheduler", None)
            if scheduler is None:
                return False
            return request_id in scheduler.active_requests or request_id in scheduler.waiting_requests

        def _submit(self, request_id, inputs, gen_config, on_output, on_stop):
            """Add the request (streamed outputs to ON_OUTPUT); ON_STOP(time_up) runs once if it is cut by its
            time limit (True) or its client's disconnect (False). Returns `done()`, to call when it finished."""
            cb = self._cb
            if cb is None:
                raise RuntimeError("Continuous batching processor not initialized.")
            self._check_alive(request_id)
            budget = take_budget(gen_config, limits)
            loop = asyncio.get_running_loop()
            token = object()
            state = {"over": False}

            def stop(time_up: bool) -> None:
                if state["over"]:
                    return
                state["over"] = True
                timer.cancel()
                cb.cancel_request(request_id)
                self._forget(request_id)
                registry.end(token, still_running=lambda: self._in_scheduler(request_id))
                on_stop(time_up)

            def done() -> None:
                if not state["over"]:
                    state["over"] = True
                    timer.cancel()
                    registry.end(token)

            cb.register_result_handler(request_id, lambda output: None if state["over"] else on_output(output))
            registry.begin(token)
            timer = loop.call_later(budget, stop, True)
            cb.add_request(
                inputs["input_ids"],
                request_id=request_id,
                streaming=True,
                max_new_tokens=gen_config.max_new_tokens,
                eos_token_id=gen_config.eos_token_id,
            )
            registry.on_cancel(request_id, lambda: loop.call_soon_threadsafe(stop, False))
            return done

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            # As transformers 5.24's CBGenerateManager.generate_streaming, plus the limits and tracking.
            fit_request(model, inputs, gen_config, limits, self.cache_tokens)
            loop = asyncio.get_running_loop()
            text_queue: asyncio.Queue = asyncio.Queue()
            rust_tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
            streamer = CBStreamer(self._cb, request_id, rust_tokenizer, loop, text_queue, response_parser)

            def on_output(output) -> None:
                try:
                    streamer.put(output)
                    if output.error is not None:
                        text_queue.put_nowait(_StreamError(output.error))
                        streamer.end()
                        done()
                    elif output.is_finished():
                        streamer.end()
                        done()
                except Exception as err:
                    text_queue.put_nowait(_StreamError(str(err)))
                    done()

            def on_stop(time_up: bool) -> None:
                if time_up:
                    mark_cut(gen_config, streamer.total_tokens)
                streamer.end()  # the stream ends with its finish_reason and usage

            done = self._submit(request_id, inputs, gen_config, on_output, on_stop)
            return text_queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            # As transformers 5.24's CBGenerateManager.generate_non_streaming, but the request streams its tokens
            # here, so that a request cut by its time limit still answers with the tokens it made.
            from fastapi import HTTPException

            fit_request(model, inputs, gen_config, limits, self.cache_tokens)
            future = asyncio.get_running_loop().create_future()
            latest: list[int] = []

            def on_output(output) -> None:
                if future.done():
                    return
                latest[:] = output.generated_tokens
                if output.error is not None:
                    fatal = self._cb.background_thread_status.fatal_error is not None
                    kind = CBWorkerDeadError if fatal else RuntimeError
                    future.set_exception(kind(f"CB generation failed for {request_id}: {output.error}"))
                elif output.is_finished():
                    future.set_result(list(output.generated_tokens))

            def on_stop(time_up: bool) -> None:
                if future.done():
                    return
                if time_up:
                    mark_cut(gen_config, len(latest))
                    future.set_result(list(latest))
                else:
                    future.set_exception(_GenerationCancelled())

            done = self._submit(request_id, inputs, gen_config, on_output, on_stop)
            try:
                generated_ids = await future
            except _GenerationCancelled:
                raise HTTPException(status_code=499, detail="the client disconnected") from None
            finally:
                done()
            text = processor.decode(generated_ids, skip_special_tokens=True)
            return text, len(inputs["input_ids"]), generated_ids

    class KHAGenerationState(GenerationState):
        def get_manager(self, model_id: str, use_cb: bool = False):
            if use_cb:
                if self._cb_manager is None or self._cb_model_id != model_id:
                    if self._cb_manager is not None:
                        self._cb_manager.stop()
                    self._cb_manager = LimitedCBGenerateManager(cb_config=self._cb_config)
                    self._cb_model_id = model_id
                return self._cb_manager
            if model_id not in self._generate_managers:
                self._generate_managers[model_id] = LimitedGenerateManager()
            return self._generate_managers[model_id]

    return KHAGenerationState
