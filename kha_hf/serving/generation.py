"""transformers' generation managers with the limits of `kha serve`: context, new tokens, time, disconnects.

transformers 5.24's `GenerateManager` runs `model.generate` on one inference thread per model, and
`CBGenerateManager` feeds its continuous-batching manager; neither caps a request by the model's context, and a
non-streamed generation runs on after its client has gone. The subclasses here add, per request:

- the prompt must fit the model's context (`max_position_embeddings`), else 400; `max_new_tokens` is cut to the
  server's limit and to what the context leaves (the reply's finish_reason says "length");
- a time limit (`max_time`, transformers' own stopping criterion) on the sequential path;
- cancellation when the client disconnects (`RequestRegistry.cancel`, called by the guard middleware);
- each generation is tracked while it runs, so `/health` can tell a stuck server.

`KHAGenerationState` hands out these managers; `kha serve` swaps it in for transformers' class while its server is
being built (the same one-call swap as the model manager's).
"""

from __future__ import annotations

from .guard import RequestRegistry, ServeLimits


def model_context(model) -> int | None:
    """The number of positions MODEL was built for, or None when its config does not say."""
    value = getattr(model.config, "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def fit_request(model, inputs: dict, gen_config, limits: ServeLimits) -> None:
    """Cut GEN_CONFIG's new tokens to the limits; HTTP 400 when the prompt alone does not fit the context."""
    from fastapi import HTTPException

    ids = inputs["input_ids"]
    prompt = len(ids) if isinstance(ids, list) else int(ids.shape[-1])
    allowed = limits.max_new_tokens
    context = model_context(model)
    if context is not None:
        if prompt >= context:
            raise HTTPException(
                status_code=400,
                detail=f"the prompt has {prompt} tokens; this model's context is {context} tokens",
            )
        allowed = min(allowed, context - prompt)
    gen_config.max_new_tokens = min(gen_config.max_new_tokens or allowed, allowed)
    gen_config.max_length = None  # max_new_tokens decides


def kha_generation_state_class(limits: ServeLimits, registry: RequestRegistry):
    """transformers' GenerationState, handing out managers that apply LIMITS and cancel through REGISTRY."""
    from transformers.cli.serving.utils import (
        CBGenerateManager,
        GenerateManager,
        GenerationState,
        _GenerationCancelled,
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
            fit_request(model, inputs, gen_config, limits)
            gen_config.max_time = limits.request_timeout
            queue, streamer = super().generate_streaming(
                model, processor, inputs, gen_config, request_id, response_parser=response_parser
            )
            registry.on_cancel(request_id, streamer.cancel)
            return queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            # As transformers 5.24's GenerateManager.generate_non_streaming, plus the limits and a streamer that
            # stops the generation when the client disconnects.
            from fastapi import HTTPException

            fit_request(model, inputs, gen_config, limits)
            gen_config.max_time = limits.request_timeout
            stopper = CancellableStreamer()
            registry.on_cancel(request_id, stopper.cancel)
            kwargs = {**inputs, "generation_config": gen_config, "tokenizer": processor, "streamer": stopper}
            if hasattr(model, "has_talker"):
                kwargs["generation_mode"] = "text"
            try:
                sequences = await self.async_submit(model.generate, **kwargs)
            except _GenerationCancelled:
                raise HTTPException(status_code=499, detail="the client disconnected") from None
            input_len = inputs["input_ids"].shape[-1]
            generated_ids = sequences[0, input_len:]
            return processor.decode(generated_ids, skip_special_tokens=True), input_len, generated_ids

    class LimitedCBGenerateManager(CBGenerateManager):
        def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
            fit_request(model, inputs, gen_config, limits)
            queue, streamer = super().generate_streaming(
                model, processor, inputs, gen_config, request_id, response_parser=response_parser
            )
            registry.on_cancel(request_id, lambda: self._cb.cancel_request(request_id))
            return queue, streamer

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            import asyncio

            fit_request(model, inputs, gen_config, limits)
            task = asyncio.ensure_future(
                super().generate_non_streaming(model, processor, inputs, gen_config, request_id)
            )
            loop = asyncio.get_running_loop()

            def cancel() -> None:  # a cancelled CB request may never deliver a result: stop waiting for it too
                self._cb.cancel_request(request_id)
                loop.call_soon_threadsafe(task.cancel)

            registry.on_cancel(request_id, cancel)
            return await task

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
