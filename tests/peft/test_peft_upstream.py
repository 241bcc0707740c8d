"""PEFT's own decoder-model tests on KnockConfig (#48 item 1), as PEFT's maintainers run them for every tuner.

`tests/test_decoder_models.py` (with its `testing_common.py` and `testing_utils.py`) comes from the sdist of the
installed peft (`tests/upstream_sdist.py`: downloaded once per version; `KHA_SKIP_UPSTREAM_TESTS=1` offline). Its
class `TestDecoderModels` runs here unchanged, with two substitutions in every test parametrized by a config:
- the config matrix is KnockConfig with each of its presets (instead of PEFT's own tuners);
- the Hub model ids are local tiny random models of the families KHA supports, saved under the same kind of id
  (`tiny-random-LlamaForCausalLM`, ...) in a folder the tests run in, so `from_pretrained(model_id)` finds them.
A test that does not apply to knocks is skipped with its one-line reason, as PEFT's own skips do (PEFT's merge
tests on MLP knocks: only after they met kha's one-line refusal); the rest must pass. Tests of PEFT's file that do
not take its full config matrix (prompt tuning, LoRA specifics) are not collected.

Counts with peft 0.21.2 (892 tests, 223 per preset): linear_qkv and linear_v 172 passed, 51 skipped each; mlp_v and
mlp_v_linear_qk 156 passed, 67 skipped each (16 of them the merge refusal).
"""

from __future__ import annotations

import functools
import inspect
import re

import peft
import pytest

from kha_hf import KNOCK_PRESETS, KnockConfig
from tests.helpers import save_tiny_checkpoint
from tests.upstream_sdist import import_sdist_tests

FILES = ["test_decoder_models.py", "testing_common.py", "testing_utils.py"]
# diffusers is not a test dependency here: only PEFT's stable-diffusion tests use its pipeline (in isinstance checks)
NO_DIFFUSERS = "class StableDiffusionPipeline:  # kha-hf: diffusers is not installed\n    pass\n"
EDITS = {"testing_common.py": [("from diffusers import StableDiffusionPipeline\n", NO_DIFFUSERS)]}
upstream = import_sdist_tests(
    "peft", peft.__version__, FILES, "peft_upstream_tests", "test_decoder_models", edits=EDITS
)

# local stand-ins for PEFT's Hub ids: the same model classes where KHA supports them, and the other core families
STAND_INS = {
    "tiny-random-LlamaForCausalLM": "llama",
    "tiny-random-Qwen2ForCausalLM": "qwen2",
    "tiny-random-MistralForCausalLM": "mistral",
    "tiny-random-Gemma3ForCausalLM": "gemma3_text",
    "tiny-random-Phi3ForCausalLM": "phi3",
    "tiny-random-Qwen3ForCausalLM": "qwen3",
}
# The presets that differ in kind (the rest are single-target cuts of these; gate_v is a control, refused by
# KnockConfig): every preset would make this file 2.5 times slower for no new code path.
UPSTREAM_PRESETS = ("mlp_v", "linear_v", "linear_qkv", "mlp_v_linear_qk", "mlp_qkv")
assert set(UPSTREAM_PRESETS) <= set(KNOCK_PRESETS)
CONFIGS = [
    pytest.param(KnockConfig, {"task_type": "CAUSAL_LM", "knock": preset}, id=preset) for preset in UPSTREAM_PRESETS
]
MLP_PRESETS = {preset for preset in KNOCK_PRESETS if "mlp" in preset}

# PEFT's tests that merge: MLP knocks (KHA-MLP) are non-linear and cannot be merged into a projection. Those tests
# must then meet kha's one-line refusal (and nothing else), and are reported as skipped with this reason.
MERGE_TESTS = {"test_merge_layers", "test_merge_layers_multi", "test_merge_layers_nan", "test_merge_layers_fp16"}
MLP_CANNOT_MERGE = "MLP knocks are non-linear and cannot be merged into the projection (kha refuses in one line)"
MLP_REFUSAL = "is an MLP (KHA-MLP), which is non-linear and cannot be merged"


def _on_knocks(name: str, test):
    """TEST (PEFT's, parametrized by model_id and config) reparametrized with our stand-ins and KnockConfig."""
    marks = []
    for mark in getattr(test, "pytestmark", []):
        if mark.name == "parametrize" and mark.args[0] == "model_id":
            mark = pytest.mark.parametrize("model_id", list(STAND_INS)).mark
        elif mark.name == "parametrize" and mark.args[0] == "config_cls,config_kwargs":
            mark = pytest.mark.parametrize("config_cls,config_kwargs", CONFIGS).mark
        marks.append(mark)

    @functools.wraps(test)
    def run(self, *args, **kwargs):
        preset = inspect.signature(test).bind(self, *args, **kwargs).arguments["config_kwargs"]["knock"]
        if name not in MERGE_TESTS or preset not in MLP_PRESETS:
            return test(self, *args, **kwargs)
        with pytest.raises(ValueError, match=re.escape(MLP_REFUSAL)):
            test(self, *args, **kwargs)
        pytest.skip(MLP_CANNOT_MERGE)

    run.pytestmark = marks
    return run


def _takes_a_config(test) -> bool:
    """True for the tests parametrized by PEFT's full config matrix (not those of one method's own configs)."""
    return any(
        m.name == "parametrize" and m.args[0] == "config_cls,config_kwargs" and m.args[1] is upstream.ALL_CONFIGS
        for m in getattr(test, "pytestmark", [])
    )


@pytest.fixture(scope="module")
def stand_in_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-stand-ins")
    for model_id, family in STAND_INS.items():
        save_tiny_checkpoint(root / model_id, family)
    return root


class TestKnockDecoderModels(upstream.TestDecoderModels):
    """PEFT's TestDecoderModels with KnockConfig's presets and local models (see the module docstring)."""

    @pytest.fixture(autouse=True)
    def _in_stand_in_folder(self, stand_in_models, monkeypatch):
        monkeypatch.chdir(stand_in_models)  # `from_pretrained("tiny-random-LlamaForCausalLM")` is a local folder


# every test of PEFT's class: the config-parametrized ones on knocks, the others (no config: not ours) removed
for _name, _test in inspect.getmembers(upstream.TestDecoderModels, inspect.isfunction):
    if _name.startswith("test_"):
        setattr(TestKnockDecoderModels, _name, _on_knocks(_name, _test) if _takes_a_config(_test) else None)
