"""transformers' own `ModelTesterMixin` run on KHA models of every supported family with perturbed knocks: the body,
the causal LM and the task heads the family has (sequence / token classification, question answering).

The mixin comes from the sdist of the installed transformers (see `upstream_common.py`). It is what every model in
transformers must pass: save/load round trips, missing-key initialisation, SDPA vs eager, the KV cache, training
and gradient checkpointing, resizing embeddings, device placement. Tests that cannot apply here are skipped by name
below, each with its reason.
"""

from __future__ import annotations

import inspect
import unittest
from unittest import mock

import pytest
import torch
from transformers import (
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers import initialization as init
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from kha_hf import (
    KHAConfig,
    KHAForCausalLM,
    KHAForQuestionAnswering,
    KHAForSequenceClassification,
    KHAForTokenClassification,
    KHAModel,
)
from kha_hf.modeling.configuration_kha import TASK_HEADS, _public_class_name, family_heads
from kha_hf.modeling.knocks import KnockLinear
from kha_hf.modeling.modeling_kha import KHAPreTrainedModel, family_classes, head_class
from tests.helpers import EXHAUSTIVE_FAMILIES, MLA_FAMILIES, OTHER_FAMILIES
from tests.modeling.upstream_common import load_modeling_common

common = load_modeling_common()

_identity_init = KHAPreTrainedModel._init_weights


def _perturbed_init(self: KHAPreTrainedModel, module: torch.nn.Module) -> None:
    """Identity (or zero-gate) knocks plus noise, so a knock that is skipped, transposed or misplaced changes outputs.

    Uses transformers' own init functions, which leave weights loaded from a checkpoint alone.
    """
    _identity_init(self, module)
    if isinstance(module, KnockLinear) and not module.weight.is_meta:
        # Its own generator: drawing from the global one would shift the random init of every weight initialised
        # after the knocks, and the mixin compares two builds whose init orders differ (Qwen3-Next's router).
        generator = torch.Generator().manual_seed(module.weight.shape[0] + (1000 if module.start == "zeros" else 0))
        noise = torch.randn(module.weight.shape, generator=generator).to(module.weight)
        init.copy_(module.weight, module.weight + 0.2 * noise)


class KHAModelTester:
    """Tiny random configs and inputs, as transformers' `CausalLMModelTester` makes them (batch 13, 7 tokens)."""

    def __init__(self, parent: unittest.TestCase, base_config: type, **family_fields) -> None:
        self.parent = parent
        self.batch_size, self.seq_length, self.vocab_size = 13, 7, 99
        self.hidden_size, self.num_hidden_layers, self.num_attention_heads = 32, 2, 4
        self.is_training = True
        self.base_config, self.family_fields = base_config, family_fields

    def get_config(self) -> KHAConfig:
        fields = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=37,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        base = self.base_config(**{**fields, **self.family_fields})
        # all three knocks, both kinds, an MLP on Q among them (MLA: linear knocks only)
        if base.model_type in MLA_FAMILIES:
            return KHAConfig.from_base(base, knock="linear_qkv")
        return KHAConfig.from_base(base, knock=None, knock_q="mlp", knock_k="linear", knock_v="mlp")

    def prepare_config_and_inputs_for_common(self) -> tuple[KHAConfig, dict[str, torch.Tensor]]:
        input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))  # left-aligned, some rows padded
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


def family_test_classes(model_type: str) -> tuple[type, ...]:
    """A family's own KHA classes: body, causal LM and the task heads its transformers code has."""
    heads = tuple(head_class(model_type, head) for head in family_heads(model_type))
    return (*family_classes(model_type)[1:], *heads)


class _KHACommonTests(common.ModelTesterMixin):
    # the public classes (they pick the family from the config), task heads included
    all_model_classes = (
        KHAModel,
        KHAForCausalLM,
        KHAForSequenceClassification,
        KHAForTokenClassification,
        KHAForQuestionAnswering,
    )
    base_config: type = LlamaConfig
    family_fields: dict = {}
    # The mixin runs this test only for models whose config file carries a copyright year >= 2023; ours has none.
    # It is the one that finds weights `_init_weights` leaves uninitialised (knocks included): opt in.
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self) -> None:
        self.model_tester = KHAModelTester(self, self.base_config, **self.family_fields)
        # The mixin finds base models and LM heads by name in transformers' static tables (labels, training, RoPE
        # and shift_labels tests), which list only transformers' own models; registration puts KHA in the Auto
        # mappings' runtime part instead. List it in the tables for the duration of each test.
        body, lm, *heads = self.all_model_classes
        patchers = [
            mock.patch.object(KHAPreTrainedModel, "_init_weights", _perturbed_init),
            mock.patch.dict(modeling_auto.MODEL_MAPPING_NAMES, {KHAConfig.model_type: body.__name__}),
            mock.patch.dict(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, {KHAConfig.model_type: lm.__name__}),
        ]
        for head in heads:  # the task heads (test_task_heads.py), found by the mixin in the same tables
            mapping = getattr(modeling_auto, TASK_HEADS[_public_class_name(head.__name__)][1])
            patchers.append(mock.patch.dict(mapping, {KHAConfig.model_type: head.__name__}))
        for patcher in patchers:
            patcher.start()
            self.addCleanup(patcher.stop)

    @pytest.mark.filterwarnings("always::FutureWarning")  # it counts a deprecation warning pyproject.toml hides
    def test_bc_cache_name_forward(self):
        super().test_bc_cache_name_forward()

    @unittest.skip(
        "asks for GenerationTesterMixin, which lives in transformers' tests/generation/test_utils.py: the sdist does "
        "not ship it (generate and the KV cache are checked against the stock model in test_parity.py)"
    )
    def test_generation_tester_mixin_inheritance(self):
        pass

    def test_moe_models_record_router_logits(self):
        # The mixin decides whether a model has sparse experts by reading the source of the module that defines it
        # for `@use_experts_implementation`; KHA reuses the family's expert modules, so read the family's module.
        mro = self.all_model_classes[0].__mro__
        family = next((c for c in mro if c.__module__.startswith("transformers.models.")), None)
        if family is None:  # a public class: its family is known only from a config
            return super().test_moe_models_record_router_logits()
        family_module = inspect.getmodule(family)
        with mock.patch.object(inspect, "getmodule", lambda *args: family_module):
            super().test_moe_models_record_router_logits()

    def test_knocks_are_perturbed(self):
        # The point of this class: if the perturbation stopped applying, every test below would only see identities.
        config = self.model_tester.get_config()
        model = KHAForCausalLM(config)
        knock = model.model.layers[config.knocked_layers[0]].self_attn.k_knock  # linear in every family's config here
        self.assertGreater((knock.weight - torch.eye(knock.weight.shape[0])).abs().max().item(), 0.1)


class KHALlamaCommonTest(_KHACommonTests, unittest.TestCase):
    base_config = LlamaConfig


class KHAQwen3CommonTest(_KHACommonTests, unittest.TestCase):
    base_config = Qwen3Config
    family_fields = {"head_dim": 8, "attention_bias": True}


class KHAMistralCommonTest(_KHACommonTests, unittest.TestCase):
    base_config = MistralConfig
    family_fields = {"sliding_window": 4}


class KHAQwen2CommonTest(_KHACommonTests, unittest.TestCase):
    base_config = Qwen2Config  # q/k/v biases by design


class KHAQwen3MoeCommonTest(_KHACommonTests, unittest.TestCase):
    # The family's own KHA classes (what `KHAForCausalLM(config)` builds): the mixin asks the class, before building
    # a model, whether its experts can use grouped_mm, and only the concrete class knows its family.
    all_model_classes = family_test_classes("qwen3_moe")
    base_config = Qwen3MoeConfig
    # 16, not 12: torch._grouped_mm (the default experts kernel) needs 16-byte strides in bf16/fp16, stock too
    family_fields = {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}


class KHAMixtralCommonTest(_KHACommonTests, unittest.TestCase):
    all_model_classes = family_test_classes("mixtral")
    base_config = MixtralConfig
    # head_dim given: with MixtralConfig's default None, dynamic and YaRN RoPE fail in stock Mixtral too
    # (transformers 5.24, rope init reads `config.head_dim`).
    family_fields = {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16}


# Sizes the mixin's tiny configs need per family. gpt_oss: 16, not 37: torch._grouped_mm (the default experts
# kernel) needs 16-byte strides in fp16/bf16, stock GPT-OSS too.
MIXIN_FIELDS = {"gpt_oss": {"intermediate_size": 16}}


def _other_family_test(model_type: str) -> type:
    """The mixin on one more family of the table: its own KHA classes, its tiny config fields cut to 2 layers."""
    fields = {k: v[:2] if k in ("layer_types", "no_rope_layers") else v for k, v in OTHER_FAMILIES[model_type].items()}
    fields.update(MIXIN_FIELDS.get(model_type, {}))
    attributes = {
        "all_model_classes": family_test_classes(model_type),
        "base_config": CONFIG_MAPPING[model_type],
        "family_fields": fields,
        "__module__": __name__,
    }
    if model_type == "qwen3_next":
        attributes["test_attention_outputs"] = unittest.skip(
            "hybrid model: only its softmax-attention layers return attention weights, and the mixin counts one per "
            "layer; stock Qwen3NextForCausalLM fails it identically (transformers 5.24)"
        )(lambda self: None)
    if model_type == "deepseek_v3":
        attributes["test_tp_plan_matches_params"] = unittest.skip(
            "the family's TP plan (transformers 5.25) lists both q_proj and q_b_proj, and a model has one of them "
            "(q_lora_rank set here: q_b_proj); stock DeepseekV3ForCausalLM of this config fails it identically"
        )(lambda self: None)
    name = f"KHA{CONFIG_MAPPING[model_type].__name__.removesuffix('Config')}CommonTest"
    return type(name, (_KHACommonTests, unittest.TestCase), attributes)


for _model_type in sorted(OTHER_FAMILIES):
    _made = _other_family_test(_model_type)
    globals()[_made.__name__] = _made


def _on_llama_only(name: str) -> bool:
    """Tests run on Llama alone. transformers' deprecated `torch_dtype` keyword (70 loads of every class, 9 s a
    family, transformers 5.25) tests transformers' from_pretrained, which KHA does not touch. The fp16 and bf16
    variants of the eager-vs-SDPA test (16 of 25; the mixin makes them per class) run the same KHA code as the fp32
    ones (knocks are dtype-agnostic), at 0.6 s a variant and class on CPUs; fp32 runs on every family."""
    if name == "test_bc_torch_dtype":
        return True
    return name.startswith("test_eager_matches_sdpa_inference_") and ("_fp16_" in name or "_bf16_" in name)


_CLASSES = [c for c in list(globals().values()) if isinstance(c, type) and issubclass(c, _KHACommonTests)]
assert EXHAUSTIVE_FAMILIES <= {c.base_config.model_type for c in _CLASSES}, "a family without its common tests"
for _made in _CLASSES:
    if _made is not KHALlamaCommonTest:
        for _name in filter(_on_llama_only, dir(_made)):
            setattr(_made, _name, unittest.skip("run on Llama (KHALlamaCommonTest)")(lambda self: None))
    if _made.base_config.model_type in EXHAUSTIVE_FAMILIES:  # the exhaustive tier (tests/helpers.py says why)
        _made.pytestmark = [pytest.mark.exhaustive]
# a module-level name bound to a TestCase class is collected again under that name: none may remain
del _made, _CLASSES
