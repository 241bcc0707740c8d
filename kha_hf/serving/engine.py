"""What `kha serve` runs in the model's process (transformers >= 5.25 runs each model in a process of its own).

transformers 5.25's server loads the model in a spawned process (its "engine"), with a pickled copy of the server's
`ModelLoader`, and the API server (the FastAPI app, in kha serve's own process) sends it requests. Everything here
is importable by name (a spawned process unpickles classes and functions by their module path) and holds no state
of the API server:

- `KHAModelLoader`: transformers' `ModelLoader`, except that KHA checkpoints (model_type "kha") load through the
  classes kha_hf registered with the Auto classes, config and tokenizer (or processor) included, without running
  any code file of the folder, even with --trust-remote-code. transformers 5.25 still resolves a checkpoint's
  class as `getattr(transformers, config.architectures[0])` (which has no KHA class) and now also reads the
  config in the API server with the server's `trust_remote_code`.
- Under continuous batching it prepares the model so that each request keeps its own temperature and top_p (see
  `prepare_for_continuous_batching`), keeps the batching manager where `engine_*` functions find it, and lets the
  batch admit new requests again after cancellations (`unblock_after_cancellations`, a 5.25 deadlock).
- `engine_*`: functions the API server runs in the model's process through transformers' `EngineClient.submit`
  (they run on its generation thread, `fn(model, processor, *args)`).
"""

from __future__ import annotations

import queue
import time
from pathlib import Path

from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import parse_model_id  # (repo or folder, revision, GGUF file) of a model id

from ..checkpoint.loading import has_processor_files, is_multimodal_checkpoint
from ..checkpoint.reader import read_config_dict

# transformers keeps up to 8 StopStringCriteria embeddings (vocabulary x stop-string positions, ~100 MB each for a
# 49k vocabulary) in a module-level cache of the model's process; kha serve keeps the 2 most recent
STOP_STRING_CACHE_ENTRIES = 2
# The settings continuous batching's manager is created with under kha serve. Its sampling warpers exist only for
# settings the creating generation config sets, and each sampling request then sends its own value of each (see
# `handlers.check_continuous_batching`): these values are never used for a sampling request's tokens. Sampling is on for
# the whole batch; a greedy request is sampled from its top-1 token (transformers' CBGenerateRunner sends top_k=1).
CB_CREATION_SAMPLING = {"do_sample": True, "temperature": 0.5, "top_p": 0.5}


def is_kha_folder(repo: str) -> bool:
    return Path(repo).is_dir() and (read_config_dict(Path(repo)) or {}).get("model_type") == "kha"


def registered() -> None:
    """KHA's classes registered with the Auto classes: `import kha_hf` does it, unless the `kha` command deferred it
    (kha_hf_entry), which a process spawned from that command's script does too."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ..modeling.configuration_kha import KHAConfig

    if KHAConfig.model_type not in CONFIG_MAPPING:
        from ..modeling.modeling_kha import register_auto_classes

        AutoConfig.register(KHAConfig.model_type, KHAConfig, exist_ok=True)
        register_auto_classes(KHAConfig)


class KHAModelLoader(ModelLoader):
    """transformers' ModelLoader, with KHA checkpoints loaded through kha_hf's classes (a multimodal one through
    AutoModelForImageTextToText, with its processor: chat requests may hold images). Pickled into the model's
    process: its state is plain settings."""

    def __init__(self, *args, continuous_batching: bool = False, **kwargs) -> None:
        super().__init__(*args, continuous_batching=continuous_batching, **kwargs)
        self.kha_continuous_batching = continuous_batching  # transformers' loader does not keep it

    def load_config(self, model_id: str):
        repo, revision, gguf_file = parse_model_id(model_id)
        if gguf_file is not None or not is_kha_folder(repo):
            return super().load_config(model_id)
        from transformers import AutoConfig, GenerationConfig

        registered()
        config = AutoConfig.from_pretrained(repo, revision=revision, trust_remote_code=False)  # the installed class
        try:
            generation_config = GenerationConfig.from_pretrained(repo, revision=revision)
        except OSError:
            generation_config = GenerationConfig.from_model_config(config)
        return config, generation_config

    def load_processor(self, model_id: str):
        repo, revision, gguf_file = parse_model_id(model_id)
        if gguf_file is not None or not is_kha_folder(repo):
            return super().load_processor(model_id)
        from transformers import AutoProcessor, AutoTokenizer

        registered()
        folder = Path(repo)
        if is_multimodal_checkpoint(folder) and has_processor_files(folder):
            # the base model's processor, without code (else the tokenizer: a text-only server)
            return AutoProcessor.from_pretrained(repo, revision=revision, trust_remote_code=False)
        return AutoTokenizer.from_pretrained(repo, revision=revision, trust_remote_code=False)

    def _load_model(self, model_id: str, tqdm_class=None, progress_callback=None):
        repo, revision, gguf_file = parse_model_id(model_id)
        if gguf_file is not None or not is_kha_folder(repo):
            return super()._load_model(model_id, tqdm_class=tqdm_class, progress_callback=progress_callback)
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        registered()
        multimodal = is_multimodal_checkpoint(Path(repo))
        return (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_pretrained(
            repo,
            revision=revision,
            attn_implementation=self.attn_implementation,
            dtype=self.dtype,
            device_map=self.device,
            trust_remote_code=False,  # the installed kha_hf classes: the folder's code files do not run
            tqdm_class=tqdm_class,
        )

    def load_model_and_processor(self, model_id: str, on_progress=None):
        model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
        generation_isolated(model)
        if self.kha_continuous_batching:
            from transformers.cli.serving.utils import GenerationState

            # as transformers decides in the model's process which runner the model gets
            if GenerationState(continuous_batching=True).use_continuous_batching(model.config, processor):
                prepare_for_continuous_batching(model)
        return model, processor


# a request's seed, as kha serve sends it to the model's process (see `generation_isolated`)
SEED_KWARG = "kha_seed"


def generation_isolated(model) -> None:
    """transformers 5.25 seeds the process-wide torch generator with a request's `seed` (`torch.manual_seed`) and
    leaves it so: every later request's random numbers followed from one client's seed (a client could replay, or
    choose, another's sampled text). kha serve sends the seed as SEED_KWARG instead (`handlers.KHAHandler`): this
    model's `generate` (this object only) then samples under `torch.random.fork_rng`, seeded with it, and the
    process's own generator (CPU and the model's accelerator) is left as it was. The sequential runner generates
    one request at a time, so no other request draws random numbers meanwhile. After each generation, the stop-string
    cache is trimmed (`trim_stop_string_cache`; stop strings are refused under continuous batching, which does not
    call `generate`)."""
    import torch

    generate = model.generate

    def generate_isolated(*args, **kwargs):
        seed = kwargs.pop(SEED_KWARG, None)
        try:
            if seed is None:
                return generate(*args, **kwargs)
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(int(seed))
                return generate(*args, **kwargs)
        finally:
            trim_stop_string_cache()

    model.generate = generate_isolated


def prepare_for_continuous_batching(model) -> None:
    """Continuous batching in transformers 5.25 builds its logits warpers once, from the generation config the manager
    is created with, and then lets each request set its own temperature, top_k and top_p, but only for the warpers
    that exist. From a greedy model config, none exist, and a request's temperature would be ignored. The model's
    generation config (in this process only: the API server reads its own copy) is made to create all three; each
    request sends all three (or top_k=1 when it decodes greedily). The manager, once created, is kept on the model
    for `engine_cb_info` and `engine_request_gone`."""
    config = model.generation_config
    for name, value in CB_CREATION_SAMPLING.items():
        setattr(config, name, value)
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    config.top_k = vocab if isinstance(vocab, int) and vocab > 0 else 50
    create = model.init_continuous_batching

    def init_and_keep(*args, **kwargs):
        manager = create(*args, **kwargs)
        model.kha_cb_manager = manager
        create_processor = manager._create_batch_processor

        def create_processor_that_unblocks():
            processor = create_processor()
            unblock_after_cancellations(processor.scheduler)
            return processor

        manager._create_batch_processor = create_processor_that_unblocks  # this manager only
        return manager

    model.init_continuous_batching = init_and_keep  # this model object only


def unblock_after_cancellations(scheduler) -> None:
    """transformers 5.25's batch scheduler stops admitting new requests when it offloads one (the cache is full,
    `block_new_requests`) and admits them again only when a request *finishes*. Requests cancelled instead (a time
    limit, a client gone) free their blocks but never finish: two requests that outgrew the cache together and were
    cut left the server refusing every later request for good. Here, once cancellations leave no request running, new
    requests are admitted again (as a finished one would have allowed)."""
    clear = scheduler.clear_cancelled_requests

    def clear_and_unblock():
        cancelled = clear()
        if cancelled and not scheduler.active_requests:
            scheduler.block_new_requests = False
        return cancelled

    scheduler.clear_cancelled_requests = clear_and_unblock  # this scheduler only


def engine_cb_info(model, processor, seconds: float = 120.0) -> dict | None:
    """Continuous batching's numbers, once its loop has built its cache: the tokens the paged cache holds
    (`cache_tokens`; one request longer than that kills transformers' batch loop for every client: "No requests can
    be scheduled and no requests can be offloaded", still so in 5.25) and the settings a request may set for itself
    (`per_request`). None when the model does not batch."""
    manager = getattr(model, "kha_cb_manager", None)
    if manager is None:
        return None
    deadline = time.monotonic() + seconds
    while getattr(manager, "batch_processor", None) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    processor_ = manager.batch_processor
    return {
        "cache_tokens": None if processor_ is None else int(processor_.cache.max_tokens_read),
        "per_request": sorted(manager.logit_processor.supported_keys),
    }


def engine_request_gone(model, processor, request_id: str) -> bool:
    """Whether the (cancelled) request REQUEST_ID no longer runs in the model's process. On the sequential runner this
    runs once the requests queued before it have left its thread: True. Under continuous batching: whether the
    batch loop has dropped it (a loop that never runs again keeps it: a stuck server)."""
    manager = getattr(model, "kha_cb_manager", None)
    if manager is None:
        return True
    scheduler = getattr(getattr(manager, "batch_processor", None), "scheduler", None)
    if scheduler is not None and (request_id in scheduler.active_requests or request_id in scheduler.waiting_requests):
        return False
    inputs = getattr(manager, "input_queue", None)
    if isinstance(inputs, queue.Queue):
        with inputs.mutex:
            return all(getattr(state, "request_id", None) != request_id for state in inputs.queue)
    return True


def trim_stop_string_cache() -> None:
    from transformers.generation import stopping_criteria

    cache = stopping_criteria.STOP_STRING_EMBEDDING_CACHE
    while len(cache) > STOP_STRING_CACHE_ENTRIES:
        cache.popitem(last=False)  # the least recently used
