"""KHA models: the stock transformers model of a base family, with knocks in its attention.

Reference: Zhou et al., "Knocking-Heads Attention", arXiv 2510.23052.

What KHA changes, and nothing else: in each knocked layer, the output of every q/k/v projection passes through the
layer's knocks (`KnockedAttention._kha_knock`) right where the family's attention calls the projection: after the
projection (and its bias), before any q/k norm, RoPE or attention kernel. Each family's attention code is its own
transformers code with that one call added (`derive.py`); where the knocks act inside a projection's output is the
family's row in `families.py`.

Classes: each base family gets three thin subclasses of its own transformers classes (attention, body, causal LM),
built when the family is first used (`family_classes`), and one for each task head it has (sequence and token
classification, question answering: `head_class`). The public classes `KHAModel`, `KHAForCausalLM` and the heads
(`KHAForSequenceClassification`, ...) pick the family's subclass from `config.base_model_type`, so `isinstance(model,
KHAForCausalLM)` holds for every family and one `auto_map` entry serves them all. A KHA model is built by the
family's own `__init__`; its `post_init` then turns the body and the attention modules into their KHA subclasses
(adding the knocks) before any weight is initialised, so family specifics of `__init__` (logit scales, MoE
attributes, ...) are never copied by hand.

This file is copied next to saved checkpoints (remote code): it may import only transformers/torch and siblings.
"""

from __future__ import annotations

import contextvars
import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init

from .configuration_kha import TASK_HEADS, KHAConfig, family_heads, multimodal_text_type
from .derive import derive_knocked_methods, find_attention_class
from .families import (
    SUPPORTED_BASE_MODEL_TYPES,
    TARGETS,
    family_spec,
    knock_dims,
    knock_plan,
    projection_features,
)
from .knocks import KnockLinear, apply_knock_plan, build_knock

# The safetensors file in which `kha convert` stores the knock tensors of a converted checkpoint.
KNOCKS_FILE = "model-kha-knocks.safetensors"
# Tags of every KHA model card (save_pretrained, and push_to_hub through `model_tags`).
KHA_TAGS = ["kha", "knocking-heads-attention", "kha-hf"]


def _drop_stale_knocks_file(folder: Path) -> None:
    """Saving into a converted checkpoint's folder leaves its knocks file (and, for a one-file save, its index)
    behind: transformers removes only its own shard names. Remove what the new weights no longer use."""
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file() and index.is_file():
        index.unlink()  # transformers writes an index only for sharded saves: this one is the old checkpoint's
    named = index.is_file() and KNOCKS_FILE in json.loads(index.read_text()).get("weight_map", {}).values()
    if (folder / KNOCKS_FILE).is_file() and not named:
        (folder / KNOCKS_FILE).unlink()


def apply_umask(folder: Path, pattern: str = "*.safetensors", folder_too: bool = False) -> None:
    """safetensors and tempfile write owner-only files (0600), tempfile.mkdtemp an owner-only folder: give FOLDER's
    files that match PATTERN (and with FOLDER_TOO the folder itself) the modes a plain copy would have. Files with
    several links (shared with another checkpoint: their mode is the source's) or another mode (a user's choice)
    are left alone. kha's own output folders take it too (`kha_hf/checkpoint/output.py`)."""
    umask = os.umask(0)
    os.umask(umask)
    if folder_too:
        folder.chmod(0o777 & ~umask)
    for path in folder.glob(pattern):
        info = path.lstat()
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and info.st_mode & 0o777 == 0o600:
            path.chmod(0o666 & ~umask)


def _tag_model_card(folder: Path, base_model_type: str) -> None:
    """Give README.md the KHA tags and Hub fields (a short card if there is none); keep what an existing card says."""
    from transformers.utils.hub import ModelCard, ModelCardData  # huggingface_hub's, as transformers uses them

    path = folder / "README.md"
    if path.is_file():
        card = ModelCard.load(path)
    else:
        data = ModelCardData(library_name="transformers", pipeline_tag="text-generation")
        body = (
            "\n# A Knocking-Heads Attention model\n\nA causal LM with Knocking-Heads Attention "
            "([arXiv 2510.23052](https://arxiv.org/abs/2510.23052)); load it with "
            "`AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)` (and its tokenizer with "
            "`AutoTokenizer.from_pretrained(PATH, trust_remote_code=True)`).\n"
        )
        card = ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
    card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *KHA_TAGS, base_model_type]))
    card.data.library_name = card.data.library_name or "transformers"
    card.data.pipeline_tag = card.data.pipeline_tag or "text-generation"
    card.save(path)


# True while `from_pretrained` loads a base (non-KHA) checkpoint into a KHA model: its knocks are missing from the
# files by design and start at the identity, so transformers' load report need not list them as "newly initialized"
# weights to train (a KHA checkpoint that lacks knock tensors is still reported).
_LOADING_BASE_CHECKPOINT = contextvars.ContextVar("kha_loading_base_checkpoint", default=False)
KNOCK_KEYS = r"\.[qkv]_knock\."


def _family_class(cls: type) -> type | None:
    """The transformers class a KHA class subclasses (None on the public classes)."""
    return next((c for c in cls.__mro__ if c.__module__.startswith("transformers.models.")), None)


def _is_kha_config(config: Any) -> bool:
    # Not isinstance: with remote code, transformers may load the config class from another module copy.
    return getattr(config, "model_type", None) == KHAConfig.model_type


def _is_kha_checkpoint(name_or_path: Any, hub_kwargs: dict) -> bool:
    """True if the checkpoint's own config.json says model_type 'kha' (not a base checkpoint read as KHA)."""
    config_dict, _ = PreTrainedConfig.get_config_dict(name_or_path, **hub_kwargs)
    return config_dict.get("model_type") == KHAConfig.model_type


class KnockedAttention(nn.Module):
    """Mixin over a family's attention class: adds `q_knock` / `k_knock` / `v_knock` and applies them.

    The family's methods that call a projection of the layout are replaced by derived copies (`derive.py`) that
    pass each projection's output through `_kha_knock`. Knocks exist only in the layers listed by
    `config.knocked_layers`; elsewhere `_kha_knock` returns its input untouched (no extra operation).
    """

    _kha_layout: dict = {}  # projection -> blocks (families.py), set on each family's subclass
    _kha_called: frozenset = frozenset()  # the projections the family's code was found to call

    def __init__(self, config: KHAConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self._add_knocks(config, layer_idx)

    def _add_knocks(self, config: KHAConfig, layer_idx: int) -> None:
        """Create this layer's knocks and the plan that applies them to each projection's output."""
        dims = knock_dims(config, self._kha_layout)
        knocked = layer_idx in config.knocked_layers
        for target in TARGETS:
            kind = getattr(config, f"knock_{target}") if knocked and target in dims else "none"
            setattr(self, f"{target}_knock", build_knock(kind, dims.get(target), config.knock_init))
        plans = {}
        for projection, blocks in self._kha_layout.items():
            module = getattr(self, projection, None)
            if module is None:
                continue  # e.g. MLA with q-LoRA has q_b_proj and no q_proj
            if projection not in self._kha_called:
                raise TypeError(f"{type(self).__name__}: the family's attention never calls {projection}")
            expected = projection_features(config, blocks)
            if getattr(module, "out_features", expected) != expected:
                raise TypeError(
                    f"{type(self).__name__}.{projection} has {module.out_features} output features; the KHA layout "
                    f"of {config.base_model_type} expects {expected}: this family's attention is not supported"
                )
            plans[projection] = self._knock_plan(config, blocks)
        self._kha_plans = plans

    def _knock_plan(self, config: KHAConfig, blocks: tuple) -> tuple | None:
        """The plan of `families.knock_plan` for this layer's knocks (None when none acts on the projection)."""
        return knock_plan(config, blocks, {t for t in TARGETS if getattr(self, f"{t}_knock") is not None})

    def _kha_knock(self, projection: str, states: torch.Tensor) -> torch.Tensor:
        """The knocks of this layer applied to the output of PROJECTION, (..., features) -> (..., features)."""
        plan = self._kha_plans.get(projection)
        return states if plan is None else apply_knock_plan(plan, states, self)


class KHAPreTrainedModel(PreTrainedModel):
    """Shared by all KHA classes: the config class, knock initialisation and the family dispatch."""

    config_class = KHAConfig
    base_model_prefix = "model"
    model_tags = KHA_TAGS  # push_to_hub tags its card with them
    _family: str | None = None  # the base model_type of a family's subclass; None on the public classes
    _public_index = 0  # position of this class in `family_classes(...)`: 1 body, 2 causal LM

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # torch's FSDP2 (`fully_shard`, torch 2.13) swaps a sharded model's class for `FSDP<Class>`, made by `type()`
        # inside torch's own module: `save_pretrained` copies the module of the model's class as its remote code, and
        # would write torch's `_fsdp_*.py` files into the checkpoint in place of this file. The class stays ours.
        if cls.__name__.startswith("FSDP") and cls.__module__.startswith("torch."):
            cls.__module__ = __name__

    def __new__(cls, config: KHAConfig | None = None, *args: Any, **kwargs: Any):
        # `KHAForCausalLM(config)` builds the subclass of the config's base family. Without a config (copy.deepcopy
        # and pickle rebuild an object of its concrete class) there is nothing to dispatch.
        return super().__new__(cls if config is None else cls._concrete_class(config))

    @classmethod
    def _concrete_class(cls, config: KHAConfig) -> type:
        if cls._family is not None:
            return cls
        if not _is_kha_config(config):
            raise TypeError(f"{cls.__name__} needs a KHAConfig, got {type(config).__name__}")
        return cls._class_for_family(config.base_model_type)

    @classmethod
    def _class_for_family(cls, model_type: str) -> type:
        """This public class's subclass for the base family MODEL_TYPE."""
        return family_classes(model_type)[cls._public_index]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args: Any, config=None, **kwargs: Any):
        """As `PreTrainedModel.from_pretrained`; a base (non-KHA) checkpoint loads with identity knocks.

        Pass `config=KHAConfig.from_base(...)` to choose the knocks for a base checkpoint, or `knock=PRESET`.

        Args:
            pretrained_model_name_or_path: a KHA checkpoint, or a checkpoint of a supported base family (folder
                or Hub id).
            *model_args: passed on to the family's class.
            config: a `KHAConfig` (default: read from the checkpoint; for a base checkpoint, its config with the
                `knock` preset, `mlp_v` unless given).
            **kwargs: transformers' `from_pretrained` keywords (`torch_dtype`, `device_map`, `revision`, ...),
                config overrides, and `knock=` / `knock_layers=` for a base checkpoint.

        Returns:
            The family's concrete subclass of this class (`KHAQwen3ForCausalLM` for a Qwen3 checkpoint), in eval
            mode, its knocks loaded or, from a base checkpoint, exactly the identity.

        Raises:
            ValueError: the checkpoint is neither KHA nor of a supported family (the message names the families).
        """
        hub_keys = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
        hub_kwargs = {k: kwargs[k] for k in hub_keys if k in kwargs}
        if cls._family is None:
            if _is_kha_config(config):
                cls = cls._concrete_class(config)
            else:
                # Peek at the config file only to pick the family; the concrete class then loads it in full,
                # with every keyword (knock=, attn_implementation=, config overrides) handled as transformers does.
                config_dict, _ = KHAConfig.get_config_dict(config or pretrained_model_name_or_path, **hub_kwargs)
                if config_dict.get("model_type") != KHAConfig.model_type:  # neither KHA nor a supported family
                    raise ValueError(
                        f"{pretrained_model_name_or_path} is a {config_dict.get('model_type')!r} model; KHA supports: "
                        f"{', '.join(SUPPORTED_BASE_MODEL_TYPES)}"
                    )
                model_type = config_dict.get("base_model_type", KHAConfig.base_model_type)
                cls = cls._class_for_family(model_type)
        try:
            base = pretrained_model_name_or_path is not None and not _is_kha_checkpoint(
                pretrained_model_name_or_path, hub_kwargs
            )
        except (OSError, ValueError):  # no readable config here (a GGUF folder...): transformers says why below
            base = False
        device_map = kwargs.get("device_map")
        disk = kwargs.get("offload_folder") or (isinstance(device_map, dict) and "disk" in device_map.values())
        if disk and base:
            # accelerate's disk offload reads every weight from the checkpoint's files, and a base checkpoint has
            # no knock tensors (transformers 5.24 / accelerate 1.x: KeyError at the first forward).
            raise ValueError(
                "disk offload needs the knocks in the checkpoint files, and this is a base checkpoint: "
                "convert it first (`kha convert SRC DST`, streaming, no extra memory), then load DST"
            )
        if cls.__module__ != "kha_hf.modeling.modeling_kha":  # loaded as remote code, without kha_hf
            register_auto_classes(cls.config_class)  # transformers registered the public class alone just before
        token = _LOADING_BASE_CHECKPOINT.set(base)
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)
        finally:
            _LOADING_BASE_CHECKPOINT.reset(token)

    def post_init(self) -> None:
        super().post_init()
        # Each model its own list: `add_model_tags` (TRL's trainers call it) appends in place, and the class's list
        # is shared by every KHA class, so one trainer's tags would reach every KHA model made after it.
        self.model_tags = list(self.model_tags or [])
        if _LOADING_BASE_CHECKPOINT.get():
            self._keys_to_ignore_on_load_missing.add(KNOCK_KEYS)  # initialised to the identity, not to train

    @classmethod
    def _from_config(cls, config: KHAConfig, **kwargs: Any):
        concrete = cls._concrete_class(config)
        return super(KHAPreTrainedModel, concrete)._from_config(config, **kwargs)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers decides whether MoE experts may use grouped_mm (and whether the attention implementation may
        # change after loading) by reading the defining module's source; KHA classes run the family's expert and
        # attention code, so ask the family's class instead.
        family = _family_class(cls)
        return family is not None and family._can_set_experts_implementation()

    @classmethod
    def is_custom_code(cls) -> bool:
        # transformers 5.24 treats classes outside its package as custom code, and then skips `_init_weights` for
        # modules without parameters of their own (a heuristic for remote code that bypasses
        # transformers.initialization): a family whose parent module initialises a child's weight, as Qwen3-Next's MoE
        # block does its router's, would keep uninitialised memory there. KHA initialises through the family's own
        # `_init_weights` and transformers.initialization, so it takes the family classes' path.
        return False

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        family = _family_class(cls)
        return family is None or family._can_set_attn_implementation()

    def save_pretrained(self, save_directory, *args: Any, is_main_process: bool = True, **kwargs: Any):
        """As `PreTrainedModel.save_pretrained`, plus a tagged model card; saving in place leaves no stale knocks."""
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process and not kwargs.get("push_to_hub"):
            _drop_stale_knocks_file(Path(save_directory))
            _tag_model_card(Path(save_directory), self.config.base_model_type)
            apply_umask(Path(save_directory))
        return result

    @classmethod
    def from_base(
        cls,
        base_model: PreTrainedModel,
        knock: str | None = "mlp_v",
        knock_layers: list[int] | None = None,
        **knock_types: str,
    ) -> KHAPreTrainedModel:
        """Upgrade an in-memory base model to KHA with identity knocks: outputs are unchanged.

        Call it on the KHA class of the base model's kind: `KHAForCausalLM.from_base(llama_lm)`,
        `KHAForSequenceClassification.from_base(reward_model)`.

        The KHA model shares the base model's tensors (no copy, no extra memory beyond the knocks); deep-copy the
        base model first if both must be trained independently.

        Args:
            base_model: a stock transformers model of a supported family (`kha_hf.SUPPORTED_BASE_MODEL_TYPES`).
            knock: a preset (`mlp_v`, the default, `linear_v`, `linear_qkv`, `mlp_qkv`, ...; `kha_hf.KNOCK_PRESETS`).
            knock_layers: the layer indices to knock (default: every softmax-attention layer).
            **knock_types: `knock_q=`, `knock_k=`, `knock_v=` (`"none"`, `"linear"`, `"mlp"`; `"gate"` on v) override
                single targets of the preset; `knock_init="random"` draws the knocks at random (the paper's Sec. 3.3
                control: the outputs then differ from the base model's).

        Returns:
            The KHA model of the base's family, on its device and in its dtype; each knock map is
            `(head_dim, head_dim)` (MLA: its no-RoPE part) and starts as the identity, so `model(ids).logits`
            equals `base_model(ids).logits` bit for bit.

        Raises:
            ValueError: the family is not supported, the preset does not fit it (an MLP knock on MLA), or the base
                model's tensors are not those the KHA model of its config holds.
            TypeError: a keyword other than `knock_q`, `knock_k`, `knock_v`.
        """
        config = KHAConfig.from_base(base_model.config, knock=knock, knock_layers=knock_layers, **knock_types)
        config._attn_implementation = base_model.config._attn_implementation
        concrete = cls._concrete_class(config)
        with torch.device("meta"):
            model = concrete(config)
        missing, unexpected = model.load_state_dict(base_model.state_dict(), strict=False, assign=True)
        if unexpected:
            raise ValueError(f"base model has tensors a KHA model lacks: {unexpected[:5]}")
        not_knocks = [k for k in missing if "_knock." not in k]
        if not_knocks:
            raise ValueError(f"base model lacks tensors: {not_knocks[:5]}")
        base_buffers = dict(base_model.named_buffers())
        device = next(base_model.parameters()).device
        dtype = base_model.dtype
        for module_name, module in model.named_modules():
            for name, buffer in list(module.named_buffers(recurse=False)):  # non-persistent (rotary) buffers
                if buffer.is_meta:
                    key = f"{module_name}.{name}" if module_name else name
                    module.register_buffer(name, base_buffers[key], persistent=False)
            if isinstance(module, KnockLinear):
                module.to_empty(device=device).to(dtype)
                module.reset_parameters()
        model.tie_weights()
        # Everything is in place (base tensors, identity knocks): mark it initialised as transformers' loading does,
        # so a later `init_weights()` leaves the base weights alone instead of re-randomising them.
        for module in model.modules():
            module._is_hf_initialized = True
            for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                tensor._is_hf_initialized = True
        if getattr(base_model, "generation_config", None) is not None:
            model.generation_config = base_model.generation_config
        return model.eval() if not base_model.training else model

    def initialize_weights(self) -> None:
        # The knocks first, and marked done: transformers initialises each sub-model's modules with that sub-model's
        # own `_init_weights` (`smart_apply`), and a multimodal model's text decoder keeps its family class, whose
        # init would give these nn.Linear subclasses a random normal init. Loaded knock tensors are left alone.
        for module in self.modules():
            if isinstance(module, KnockLinear) and not getattr(module, "_is_hf_initialized", False):
                self._init_weights(module)
                module._is_hf_initialized = not module.weight.is_meta
        super().initialize_weights()

    def _init_weights(self, module: nn.Module) -> None:
        # Knocks first: the base families would give these nn.Linear subclasses a random normal init.
        if isinstance(module, KnockLinear):
            if module.weight.is_meta:
                return  # built without storage (vLLM's loader): real values are loaded or initialised later
            if module.start == "identity":
                init.eye_(module.weight)
            elif module.start == "zeros":
                init.zeros_(module.weight)
            else:  # knock_init="random": nn.Linear's own draw (KnockLinear.reset_parameters)
                init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        else:
            super()._init_weights(module)


class KHAModel(KHAPreTrainedModel):
    """The decoder body (no LM head) of a KHA model; see `KHAForCausalLM`.

    The family's own body class with knocked attention: `input_ids` of shape `(batch, seq)` give
    `last_hidden_state` of shape `(batch, seq, hidden_size)`.
    """

    _public_index = 1
    _attention_class: type | None = None
    _family_attention: type | None = None  # the family's own attention class

    def post_init(self) -> None:
        self._knock_attention()  # before weights are initialised
        super().post_init()

    def _knock_attention(self) -> None:
        """Turn each layer's family attention into the KHA subclass and add its knocks (the module keeps its own
        projections and state: nothing is built twice)."""
        _knock_layers(self, type(self), self.config)


def _knock_layers(body: nn.Module, kha_body: type, config: KHAConfig) -> None:
    """Knock the softmax-attention layers of BODY (a decoder body of KHA_BODY's family, or of KHA_BODY itself) with
    the knocks of CONFIG: each family attention module becomes KHA_BODY's attention subclass. Hybrid models keep
    their other layers; a layer already knocked is left as it is."""
    for layer_idx, layer in enumerate(body.layers):
        attention = getattr(layer, "self_attn", None)
        if type(attention) is kha_body._family_attention:
            attention.__class__ = kha_body._attention_class
            attention._add_knocks(config, layer_idx)


def _knock_language_model(root: nn.Module, config: KHAConfig) -> None:
    """Knock the text decoder inside the multimodal model ROOT: the attention modules of the one module of the text
    family's body class (`Gemma3TextModel`, `Qwen2_5_VLTextModel`, `LlamaModel` in SmolVLM) become KHA attention
    with the knocks of CONFIG. The text body keeps its own class: vLLM's Transformers backend decorates the
    decoder class it finds on a model of the same config (`type(model.get_decoder())`, vLLM 0.32) and expects each
    decoder it then builds to have run that class's `__init__`, which a class swapped in afterwards has not. The
    vision tower, the projector and everything else stay the family's modules, untouched."""
    knock_config = config.knock_config
    _, kha_body, _ = family_classes(knock_config.base_model_type)
    family_body = _family_class(kha_body)
    bodies = [module for module in root.modules() if type(module) in (family_body, kha_body)]
    if len(bodies) != 1:
        raise TypeError(
            f"{type(root).__name__} holds {len(bodies)} {family_body.__name__} modules; KHA knocks exactly one "
            "text decoder"
        )
    _knock_layers(bodies[0], kha_body, knock_config)


class KHAMultimodalModel(KHAModel):
    """Mixin for the body of a multimodal KHA model (the family's `...Model`: vision tower, projector, language
    model): the knocks go into its language model only."""

    def _knock_attention(self) -> None:
        _knock_language_model(self, self.config)


def _become(model: PreTrainedModel, cls: type) -> None:
    """Make MODEL an instance of CLS, a KHA subclass of its class that adds no state of its own. transformers 5.24
    files each model's `_can_record_outputs` (hidden states, attentions, MoE router logits) under its class name when
    the model is built (utils/output_capturing.py): file it under the new name too."""
    model.__class__ = cls
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # releases that read the class attribute directly
        return
    if type(_CAN_RECORD_REGISTRY) is dict:  # 5.16.1 (the floor): a plain dict keyed by the class's name
        _CAN_RECORD_REGISTRY[str(cls)] = model._can_record_outputs
    else:  # 5.24: a registry that takes the model and files it under its class's name
        _CAN_RECORD_REGISTRY[model] = model._can_record_outputs


class KHAForCausalLM(KHAPreTrainedModel, GenerationMixin):
    """A causal LM of any supported base family with Knocking-Heads Attention.

    Build one from a config (`KHAForCausalLM(KHAConfig.from_base(base_config))`), upgrade an in-memory model
    (`KHAForCausalLM.from_base(model)`), or load a KHA or base checkpoint with `from_pretrained`.

    The object is the family's own causal LM (`KHAQwen3ForCausalLM` subclasses `Qwen3ForCausalLM`), so `forward`,
    `generate`, the KV cache and every attention kernel are the family's: `input_ids` of shape `(batch, seq)` give
    `logits` of shape `(batch, seq, vocab_size)`. Its only difference is in each knocked layer's attention: the
    knocks, shared by all heads of the layer, act on every head's query / key / value features (each head's
    `head_dim` features; the KV heads' under GQA) right after the projections, before any q/k norm and RoPE.
    """

    _body_class: type | None = None
    _public_index = 2

    def post_init(self) -> None:
        # The family's __init__ built its own body class (hard-coded there): make it the KHA body, add the knocks.
        if type(self.model) is not self._body_class:
            _become(self.model, self._body_class)
            self.model._knock_attention()
        super().post_init()


class KHAForConditionalGeneration(KHAForCausalLM):
    """A multimodal model (the family's image-text-to-text `...ForConditionalGeneration`: Gemma 3, Qwen2.5-VL,
    Mistral 3, SmolVLM, ...) with Knocking-Heads Attention in its text decoder; the vision tower is the family's.

    Load with `AutoModelForImageTextToText` (or `AutoModelForCausalLM`, as for the stock family) and the family's
    processor; `isinstance(model, KHAForCausalLM)` holds.
    """

    @classmethod
    def _class_for_family(cls, model_type: str) -> type:
        if multimodal_text_type(model_type) is None:
            raise ValueError(f"{model_type!r} is a text-only model: load it with KHAForCausalLM")
        return family_classes(model_type)[2]

    def post_init(self) -> None:
        body = getattr(self, self.base_model_prefix, None)
        if self._body_class is not None and body is not None and type(body) is _family_class(self._body_class):
            _become(body, self._body_class)
        _knock_language_model(self, self.config)
        KHAPreTrainedModel.post_init(self)


class KHAHeadModel(KHAPreTrainedModel):
    """Shared by the task-head classes (`KHAForSequenceClassification`, ...): the family's own head class (its
    `score` / `qa_outputs` layer, loss and pooling) over the family's KHA body. transformers' generic heads build the
    body with `AutoModel.from_config(config)`, which gives the KHA body once KHA is registered with the Auto classes;
    a family that builds its own body class gets it turned into the KHA body here, as `KHAForCausalLM` does."""

    _body_class: type | None = None

    @classmethod
    def _class_for_family(cls, model_type: str) -> type:
        return head_class(model_type, cls.__name__)

    def __init__(self, config: KHAConfig, *args: Any, **kwargs: Any) -> None:
        # The generic heads build the body with `AutoModel.from_config(config)`: AutoModel must know this config's
        # class. As remote code, transformers loads configuration_kha.py once more as a module of its own (another
        # hash), so the config's class is not the one this module imports and registered.
        from transformers import AutoModel

        bodies = [_BUILT[model_type][1] for model_type in sorted(_BUILT)]  # every family has a body
        AutoModel.register(type(config), (KHAModel, *bodies), exist_ok=True)
        super().__init__(config, *args, **kwargs)

    def post_init(self) -> None:
        body = getattr(self, self.base_model_prefix)
        if type(body) is not self._body_class:
            _become(body, self._body_class)
            body._knock_attention()
        super().post_init()


class KHAForSequenceClassification(KHAHeadModel):
    """A sequence classifier or reward model (the family's `...ForSequenceClassification`) with KHA.

    `input_ids` of shape `(batch, seq)` give `logits` of shape `(batch, num_labels)` (the score at each sequence's
    last non-pad token, so the config needs `pad_token_id` for batches longer than one); `num_labels=1` is a reward
    model. Build it with `from_base(stock_head_model)` or `from_pretrained`, or let `kha convert` keep the head.
    """


class KHAForTokenClassification(KHAHeadModel):
    """A token classifier (the family's `...ForTokenClassification`) with KHA.

    `input_ids` of shape `(batch, seq)` give `logits` of shape `(batch, seq, num_labels)`.
    """


class KHAForQuestionAnswering(KHAHeadModel):
    """An extractive question-answering model (the family's `...ForQuestionAnswering`) with KHA.

    `input_ids` of shape `(batch, seq)` give `start_logits` and `end_logits`, each of shape `(batch, seq)`.
    """


PUBLIC_HEADS = {
    cls.__name__: cls for cls in (KHAForSequenceClassification, KHAForTokenClassification, KHAForQuestionAnswering)
}
assert set(PUBLIC_HEADS) == set(TASK_HEADS)


# --- each family's three subclasses, built on first use ---------------------------------------------------------
def _transformers_class(mapping_name: str, model_type: str) -> type:
    import transformers
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, mapping_name)
    if model_type not in names:
        raise ValueError(
            f"transformers has no {mapping_name.removesuffix('_NAMES').lower()} class for {model_type!r}; "
            f"KHA supports: {', '.join(SUPPORTED_BASE_MODEL_TYPES)}"
        )
    return getattr(transformers, names[model_type])


_BUILT: dict[str, tuple[type, type, type]] = {}  # model_type -> its classes, built once


def family_classes(model_type: str) -> tuple[type, type, type]:
    """(attention, body, causal LM): the KHA subclasses of MODEL_TYPE's transformers classes."""
    if model_type in _BUILT:
        return _BUILT[model_type]
    if multimodal_text_type(model_type) is not None:
        return _multimodal_classes(model_type)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    spec = family_spec(model_type)
    body_family = _transformers_class("MODEL_MAPPING_NAMES", model_type)
    # a text decoder that exists only inside a multimodal model (qwen2_5_vl_text) has a body and no causal LM
    has_lm = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    lm_family = _transformers_class("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", model_type) if has_lm else None
    projections = set(spec.layout)
    try:
        attention_family = find_attention_class(sys.modules[body_family.__module__], projections)
        methods, called = derive_knocked_methods(attention_family, projections)
    except TypeError as err:
        raise ValueError(
            f"model type {model_type!r} is not supported: {err}. KHA supports: {', '.join(SUPPORTED_BASE_MODEL_TYPES)}"
        ) from err
    if not called:
        raise ValueError(f"model type {model_type!r}: its attention calls none of {', '.join(sorted(projections))}")
    knocked = {**methods, "_kha_layout": spec.layout, "_kha_called": frozenset(called)}
    attention = _kha_class(KnockedAttention, attention_family, model_type, knocked, own=())
    body = _kha_class(
        KHAModel, body_family, model_type, {"_attention_class": attention, "_family_attention": attention_family}
    )
    lm = lm_family and _kha_class(KHAForCausalLM, lm_family, model_type, {"_body_class": body})
    return _register_family(model_type, (attention, body, lm))


def _kha_class(public: type, family: type, model_type: str, attributes: dict, own: tuple | None = None) -> type:
    """`KHA<family>`: the subclass of PUBLIC (a KHA class) and FAMILY (its transformers class) with ATTRIBUTES, made
    importable by name (pickle, torch.save of whole models). It takes the family's own values of OWN (default: the
    attributes families declare about themselves, `_no_split_modules` and `forward`), not the public class's."""
    cls = type(f"KHA{family.__name__}", (public, family), {"_family": model_type, "__module__": __name__, **attributes})
    for name in (*_FAMILY_ATTRIBUTES, "_no_split_modules", "forward") if own is None else own:
        if hasattr(family, name):
            setattr(cls, name, getattr(family, name))
    setattr(sys.modules[__name__], cls.__name__, cls)
    return cls


def _register_family(model_type: str, built: tuple) -> tuple:
    """Keep MODEL_TYPE's classes BUILT (attention, body, causal LM) and register the body and the LM."""
    _BUILT[model_type] = built
    for cls in built[1:]:
        if cls is not None:
            _register_classes(cls, model_type)
    return built


def _multimodal_classes(model_type: str) -> tuple[type | None, type, type]:
    """(None, body, image-text-to-text model): KHA subclasses of a multimodal family's own classes. Their knocks go
    into the text decoder, whose KHA classes are found from each model's `text_config` (`_knock_language_model`)."""
    body_family = _transformers_class("MODEL_MAPPING_NAMES", model_type)
    lm_family = _transformers_class("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", model_type)
    body = None
    if body_family is not lm_family:  # Llama 4 has no body class: transformers' AutoModel gives the whole model
        body = _kha_class(KHAMultimodalModel, body_family, model_type, {})
    lm = _kha_class(KHAForConditionalGeneration, lm_family, model_type, {"_body_class": body})
    return _register_family(model_type, (None, body or lm, lm))


_HEADS_BUILT: dict[tuple[str, str], type] = {}  # (model_type, public head name) -> its class, built once


def head_class(model_type: str, public: str) -> type:
    """The KHA subclass of MODEL_TYPE's own transformers head class for the public head PUBLIC
    (e.g. `KHAForSequenceClassification` on qwen3 -> `KHAQwen3ForSequenceClassification`)."""
    import transformers

    if (model_type, public) in _HEADS_BUILT:
        return _HEADS_BUILT[(model_type, public)]
    _, body, _ = family_classes(model_type)
    family_name = family_heads(model_type).get(public)
    if family_name is None:
        kind = public.removeprefix("KHAFor")
        have = ", ".join(family_heads(model_type)) or "none"
        raise ValueError(f"transformers has no {kind} class for {model_type!r}, so KHA has none (its heads: {have})")
    # the family's own values; base_model_prefix too (question answering keeps `transformer` for old checkpoints)
    own = (*_FAMILY_ATTRIBUTES, "_no_split_modules", "forward", "base_model_prefix")
    family = getattr(transformers, family_name)
    cls = _kha_class(PUBLIC_HEADS[public], family, model_type, {"_body_class": body}, own)
    _HEADS_BUILT[(model_type, public)] = cls
    _register_classes(cls, model_type)
    return cls


def _register_classes(cls: type, model_type: str) -> None:
    # transformers converts some families' on-disk layout at load (e.g. Mixtral's per-expert w1/w2/w3 into fused
    # expert tensors, Gemma 3's `language_model.model.` prefix) and back at save, keyed by model_type, which for KHA
    # is "kha". Register the family's mapping under our class names so KHA models read and write exactly the base
    # family's checkpoint layout.
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    # transformers looks a module's mapping up by class name, then by model_type: the family class's own entry
    # first (Gemma3Model has one of its own, beside the gemma3 one of Gemma3ForConditionalGeneration)
    family = _family_class(cls)
    mapping = (family and get_checkpoint_conversion_mapping(family.__name__)) or get_checkpoint_conversion_mapping(
        model_type
    )
    if mapping:
        register_checkpoint_conversion_mapping(cls.__name__, mapping, overwrite=True)
    if _AUTO_REGISTRATION:
        register_auto_classes(_AUTO_REGISTRATION[0])


_AUTO_REGISTRATION: list[type] = []  # the config class the Auto classes know KHA under, once registered


# What the families declare about themselves. The public classes advertise the values the core families share, so
# code that inspects a class before building a model (the Auto classes, pipelines, Trainer, transformers' own model
# tests) sees what KHA supports; each family's classes then carry their family's own values (set above).
_FAMILY_ATTRIBUTES = (
    "_supports_sdpa",
    "_supports_flash_attn",
    "_supports_flex_attn",
    "_supports_attention_backend",
    "_can_compile_fullgraph",
    "_skip_keys_device_placement",
    "supports_gradient_checkpointing",
    "_tied_weights_keys",
    "_tp_plan",
    "_pp_plan",
)
_CORE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def _advertise_family_attributes() -> None:
    publics = [(KHAModel, "MODEL_MAPPING_NAMES", ()), (KHAForCausalLM, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", ())]
    publics += [(cls, TASK_HEADS[name][1], ("base_model_prefix",)) for name, cls in PUBLIC_HEADS.items()]
    for public, mapping, extra in publics:
        families = [_transformers_class(mapping, model_type) for model_type in _CORE_FAMILIES]
        for name in (*_FAMILY_ATTRIBUTES, *extra):
            values = [getattr(family, name) for family in families]
            if all(value == values[0] for value in values):
                setattr(public, name, values[0])
        public._no_split_modules = sorted({layer for family in families for layer in family._no_split_modules})
        public.forward = families[0].forward  # the signature every family shares (MoE families add router outputs)


_advertise_family_attributes()


def register_auto_classes(config_class: type) -> None:
    """Register KHA with transformers' Auto classes under CONFIG_CLASS: the public classes first (what
    `AutoModelForCausalLM` builds), then each family's classes built so far (and later ones as they are built), so
    that pipelines, which look an instance's class name up in the Auto mapping, recognise `KHAQwen3ForCausalLM`."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    _AUTO_REGISTRATION[:] = [config_class]
    built = [_BUILT[model_type] for model_type in sorted(_BUILT)]
    for auto, public, index in ((AutoModel, KHAModel, 1), (AutoModelForCausalLM, KHAForCausalLM, 2)):
        classes = (public, *(family[index] for family in built if family[index] is not None))
        auto.register(config_class, classes, exist_ok=True)
    multimodal = (family[2] for family in built if family[2] is not None and family[0] is None)
    AutoModelForImageTextToText.register(config_class, (KHAForConditionalGeneration, *multimodal), exist_ok=True)
    for name, public in PUBLIC_HEADS.items():
        heads = [_HEADS_BUILT[key] for key in sorted(_HEADS_BUILT) if key[1] == name]
        getattr(transformers, TASK_HEADS[name][0]).register(config_class, (public, *heads), exist_ok=True)


def __getattr__(name: str) -> type:
    """A family's KHA class by name (`KHALlamaForCausalLM`), built on first use: unpickling a whole model
    (`torch.save`) in a new process looks its class up here before anything in that process has built it."""
    from transformers.models.auto import modeling_auto

    heads = {mapping: public for public, (_, mapping) in TASK_HEADS.items()}
    lms = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_MAPPING_NAMES")
    for mapping in (*lms, *heads) if name.startswith("KHA") else ():
        for model_type, family in getattr(modeling_auto, mapping).items():
            if family != name.removeprefix("KHA"):
                continue
            if model_type in SUPPORTED_BASE_MODEL_TYPES or multimodal_text_type(model_type) is not None:
                if mapping in heads:
                    head_class(model_type, heads[mapping])
                else:
                    family_classes(model_type)
            if name in globals():
                return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
