"""transformers' own `ModelTesterMixin` (from the sdist of the installed transformers: `upstream_common.py`) on
multimodal KHA models with perturbed knocks: the body and the image-text-to-text model of Gemma 3, Qwen2.5-VL,
Idefics3 and Mistral 3, with an image in every input (`multimodal_helpers.py`).

transformers' per-family testers (which override a few mixin tests for multimodal models) are not in its sdist, so
the generic mixin runs with our tiny configs. Under it, the tests in `FAILS_ON_STOCK` fail for the stock
transformers classes too (run here with the same tester and inputs, transformers 5.24: the stock twin of this file
was run once and its failures recorded below); they are skipped for KHA with that reason. Every other test runs."""

from __future__ import annotations

import unittest
from unittest import mock

import pytest
import torch
from transformers.models.auto import modeling_auto

from kha_hf import KHAConfig
from kha_hf.modeling.modeling_kha import KHAPreTrainedModel, family_classes
from tests.modeling.test_transformers_common import _perturbed_init, common
from tests.multimodal_helpers import multimodal_config, multimodal_inputs

_SHARED = (
    "test_attention_outputs",
    "test_hidden_states_output",
    "test_get_image_features_attentions",
    "test_get_image_features_hidden_states",
    "test_bc_cache_name_forward",
    "test_resize_tokens_embeddings",
    "test_resize_embeddings_untied",
)
_FEATURE_OUTPUTS = ("test_get_image_features_output_0", "test_get_image_features_output_2")
# family -> the mixin's tests that fail for the stock classes under this generic tester too (run with the same
# tester and inputs on transformers 5.24; e.g. the mixin reads `num_hidden_layers` from a family tester, and a
# resized vocabulary loses the image tokens' placeholders). transformers' own per-family testers override them.
FAILS_ON_STOCK: dict[str, tuple[str, ...]] = {
    "gemma3": _SHARED,
    "qwen2_5_vl": (
        *_SHARED,
        *_FEATURE_OUTPUTS,
        "test_get_video_features_output_0",
        "test_get_video_features_output_2",
        "test_get_video_features_attentions",
        "test_get_video_features_hidden_states",
    ),
    "idefics3": _SHARED,
    "mistral3": (*_SHARED, *_FEATURE_OUTPUTS, "test_vision_axial_rope"),
}


class KHAMultimodalTester:
    """A tiny multimodal KHA config (all three knocks, both kinds) and inputs with one image per row."""

    def __init__(self, parent: unittest.TestCase, family: str) -> None:
        self.parent, self.family = parent, family
        self.batch_size, self.seq_length = 2, 14
        self.is_training = True

    def get_config(self) -> KHAConfig:
        return KHAConfig.from_base(multimodal_config(self.family), knock="mlp_v_linear_qk")

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        return config, multimodal_inputs(config, batch=self.batch_size, seq=self.seq_length)


class _MultimodalCommonTests(common.ModelTesterMixin):
    family = "gemma3"
    test_can_init_all_missing_weights_before_2023 = True  # the test that finds uninitialised weights: opt in

    def setUp(self) -> None:
        self.model_tester = KHAMultimodalTester(self, self.family)
        body, lm = self.all_model_classes
        patchers = [  # the mixin finds models by name in transformers' static tables: list KHA's there
            mock.patch.object(KHAPreTrainedModel, "_init_weights", _perturbed_init),
            mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, {KHAConfig.model_type: body.__name__}),
            mock.patch.dict(
                modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, {KHAConfig.model_type: lm.__name__}
            ),
        ]
        for patcher in patchers:
            patcher.start()
            self.addCleanup(patcher.stop)

    @unittest.skip("transformers' torch_dtype keyword alias, 70 loads: run on Llama (test_transformers_common.py)")
    def test_bc_torch_dtype(self):
        pass

    @unittest.skip("GenerationTesterMixin is not in the transformers sdist (generate: test_multimodal.py)")
    def test_generation_tester_mixin_inheritance(self):
        pass

    def test_knocks_are_perturbed(self):
        # if the perturbation stopped applying, every test here would only see identity knocks
        model = self.all_model_classes[1](self.model_tester.get_config())
        knock = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_knock"))
        self.assertGreater((knock.weight - torch.eye(knock.weight.shape[0])).abs().max().item(), 0.1)


def _family_test(family: str) -> type:
    attributes = {"family": family, "all_model_classes": family_classes(family)[1:], "__module__": __name__}
    for name in FAILS_ON_STOCK[family]:
        reason = f"fails for the stock {family} classes too under this generic tester (transformers 5.24)"
        attributes[name] = unittest.skip(reason)(lambda self: None)
    name = f"KHA{family.title().replace('_', '')}MultimodalCommonTest"
    return type(name, (_MultimodalCommonTests, unittest.TestCase), attributes)


# Idefics3 (SigLIP and a Llama decoder) and Mistral 3 (Pixtral and a Mistral decoder) put image features into a
# Llama-shaped decoder as Gemma 3 and Qwen2.5-VL do, through the same KHA classes: the exhaustive tier
# (tests/conftest.py, KHA_EXHAUSTIVE=1)
EXHAUSTIVE_MULTIMODAL = {"idefics3", "mistral3"}
for _family in FAILS_ON_STOCK:
    _made = _family_test(_family)
    if _family in EXHAUSTIVE_MULTIMODAL:
        _made.pytestmark = [pytest.mark.exhaustive]
    globals()[_made.__name__] = _made
del _made  # a module-level name bound to a TestCase class is collected again under that name
