"""KHA models: the stock transformers Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral models with knocks.

Reference: Zhou et al., "Knocking-Heads Attention", arXiv 2510.23052.

Design: each base family gets three thin subclasses of its own transformers classes (attention, body, causal LM).
Only the attention forward changes (the knock step); everything else is inherited. The public classes `KHAModel`
and `KHAForCausalLM` pick the family's subclass from `config.base_model_type`, so
`isinstance(model, KHAForCausalLM)` holds for every family and one `auto_map` entry serves them all.

This file is copied next to saved checkpoints (remote code): it may import only transformers/torch and siblings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralForCausalLM, MistralModel
from transformers.models.mixtral.modeling_mixtral import MixtralAttention, MixtralForCausalLM, MixtralModel
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM, Qwen2Model
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3Model
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeForCausalLM, Qwen3MoeModel
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_kha import KHAConfig
from .knocks import KnockLinear, build_knock

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


def _apply_umask(folder: Path) -> None:
    """safetensors writes weight files owner-only (0600); give them the mode a plain copy would have. Files with
    several links (shared with another checkpoint) are left alone."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.glob("*.safetensors"):
        info = path.lstat()
        if path.is_file() and not path.is_symlink() and info.st_nlink == 1 and info.st_mode & 0o777 == 0o600:
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


def _is_kha_config(config: Any) -> bool:
    # Not isinstance: with remote code, transformers may load the config class from another module copy.
    return getattr(config, "model_type", None) == KHAConfig.model_type


def _is_kha_checkpoint(name_or_path: Any, hub_kwargs: dict) -> bool:
    """True if the checkpoint's own config.json says model_type 'kha' (not a base checkpoint read as KHA)."""
    config_dict, _ = PreTrainedConfig.get_config_dict(name_or_path, **hub_kwargs)
    return config_dict.get("model_type") == KHAConfig.model_type


class KnockedAttention(nn.Module):
    """Mixin over a family's attention class: adds `q_knock` / `k_knock` / `v_knock` and applies them.

    Knocks exist only in the layers listed by `config.knocked_layers`; elsewhere the forward equals the base one.
    """

    def __init__(self, config: KHAConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        knocked = layer_idx in config.knocked_layers
        self.q_knock = build_knock(config.knock_q if knocked else "none", self.head_dim)
        self.k_knock = build_knock(config.knock_k if knocked else "none", self.head_dim)
        self.v_knock = build_knock(config.knock_v if knocked else "none", self.head_dim)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape)  # (B, T, n_q, d_h)
        key_states = self.k_proj(hidden_states).view(hidden_shape)  # (B, T, n_kv, d_h)
        value_states = self.v_proj(hidden_states).view(hidden_shape)  # (B, T, n_kv, d_h)
        # KHA (diff with the base family): knocks shared by all heads act on each head's features here, after the
        # projection and before the q/k norm (Qwen3) and RoPE; under GQA the K/V knocks act on the KV heads.
        if self.q_knock is not None:
            query_states = self.q_knock(query_states)
        if self.k_knock is not None:
            key_states = self.k_knock(key_states)
        if self.v_knock is not None:
            value_states = self.v_knock(value_states)
        if getattr(self, "q_norm", None) is not None:  # Qwen3 / Qwen3-MoE QK RMSNorm
            query_states = self.q_norm(query_states)
            key_states = self.k_norm(key_states)
        query_states = query_states.transpose(1, 2)  # (B, n_q, T, d_h)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        # Qwen2/Qwen3 set a per-layer window on the module, Mistral/Mixtral read the config, Llama has none.
        sliding_window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=sliding_window,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class KHAPreTrainedModel(PreTrainedModel):
    """Shared by all KHA classes: the config class, knock initialisation and the family dispatch."""

    config_class = KHAConfig
    base_model_prefix = "model"
    model_tags = KHA_TAGS  # push_to_hub tags its card with them
    # family model_type -> concrete subclass; filled below for KHAModel and KHAForCausalLM
    _family_classes: dict[str, type] = {}
    _family: str | None = None

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
        return cls._family_classes[config.base_model_type]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args: Any, config=None, **kwargs: Any):
        """As `PreTrainedModel.from_pretrained`; a base (non-KHA) checkpoint loads with identity knocks.

        Pass `config=KHAConfig.from_base(...)` to choose the knocks for a base checkpoint, or `knock=PRESET`.
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
                        f"{', '.join(cls._family_classes)}"
                    )
                cls = cls._family_classes[config_dict.get("base_model_type", KHAConfig.base_model_type)]
        device_map = kwargs.get("device_map")
        disk = kwargs.get("offload_folder") or (isinstance(device_map, dict) and "disk" in device_map.values())
        if disk and not _is_kha_checkpoint(pretrained_model_name_or_path, hub_kwargs):
            # accelerate's disk offload reads every weight from the checkpoint's files, and a base checkpoint has
            # no knock tensors (transformers 5.24 / accelerate 1.x: KeyError at the first forward).
            raise ValueError(
                "disk offload needs the knocks in the checkpoint files, and this is a base checkpoint: "
                "convert it first (`kha convert SRC DST`, streaming, no extra memory), then load DST"
            )
        if cls.__module__ != "kha_hf.modeling.modeling_kha":  # loaded as remote code, without kha_hf
            register_auto_classes(cls.config_class)  # transformers registered the public class alone just before
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config: KHAConfig, **kwargs: Any):
        concrete = cls._concrete_class(config)
        return super(KHAPreTrainedModel, concrete)._from_config(config, **kwargs)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers decides whether MoE experts may use grouped_mm by reading the defining module's source for
        # its decorator; KHA classes reuse the family's expert modules, so ask the family's class instead.
        family = next((c for c in cls.__mro__ if c.__module__.startswith("transformers.models.")), None)
        return family is not None and family._can_set_experts_implementation()

    def save_pretrained(self, save_directory, *args: Any, is_main_process: bool = True, **kwargs: Any):
        """As `PreTrainedModel.save_pretrained`, plus a tagged model card; saving in place leaves no stale knocks."""
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process and not kwargs.get("push_to_hub"):
            _drop_stale_knocks_file(Path(save_directory))
            _tag_model_card(Path(save_directory), self.config.base_model_type)
            _apply_umask(Path(save_directory))
        return result

    def _init_weights(self, module: nn.Module) -> None:
        # Knocks first: the base families would give these nn.Linear subclasses a random normal init.
        if isinstance(module, KnockLinear):
            if module.start == "identity":
                init.eye_(module.weight)
            else:
                init.zeros_(module.weight)
        else:
            super()._init_weights(module)


class KHAModel(KHAPreTrainedModel):
    """The decoder body (no LM head) of a KHA model; see `KHAForCausalLM`."""

    _attention_class: type | None = None

    def post_init(self) -> None:
        # The base body hard-codes its attention class: swap in the knocked one before weights are initialised.
        for layer_idx, layer in enumerate(self.layers):
            layer.self_attn = self._attention_class(self.config, layer_idx)
        super().post_init()


class KHAForCausalLM(KHAPreTrainedModel, GenerationMixin):
    """A causal LM of any supported base family with Knocking-Heads Attention.

    Build one from a config (`KHAForCausalLM(KHAConfig.from_base(base_config))`), upgrade an in-memory model
    (`KHAForCausalLM.from_base(model)`), or load a KHA or base checkpoint with `from_pretrained`.
    """

    _body_class: type | None = None

    def __init__(self, config: KHAConfig) -> None:
        # Mirrors the base family's __init__ (whose body class is hard-coded) with the KHA body.
        PreTrainedModel.__init__(self, config)
        self.model = self._body_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if hasattr(config, "router_aux_loss_coef"):  # MoE families: read by forward for the router aux loss
            self.router_aux_loss_coef = config.router_aux_loss_coef
            self.num_experts = config.num_experts
            self.num_experts_per_tok = config.num_experts_per_tok
        self.post_init()

    @classmethod
    def from_base(
        cls,
        base_model: PreTrainedModel,
        knock: str | None = "mlp_v",
        knock_layers: list[int] | None = None,
        **knock_types: str,
    ) -> KHAForCausalLM:
        """Upgrade an in-memory base model to KHA with identity knocks: outputs are unchanged.

        The KHA model shares the base model's tensors (no copy, no extra memory beyond the knocks); deep-copy the
        base model first if both must be trained independently.
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
        model.generation_config = base_model.generation_config
        return model.eval() if not base_model.training else model


# --- one thin subclass per base family ------------------------------------------------------------------------
class KHALlamaAttention(KnockedAttention, LlamaAttention):
    pass


class KHAMistralAttention(KnockedAttention, MistralAttention):
    pass


class KHAQwen2Attention(KnockedAttention, Qwen2Attention):
    pass


class KHAQwen3Attention(KnockedAttention, Qwen3Attention):
    pass


class KHAQwen3MoeAttention(KnockedAttention, Qwen3MoeAttention):
    pass


class KHAMixtralAttention(KnockedAttention, MixtralAttention):
    pass


class KHALlamaModel(KHAModel, LlamaModel):
    _family, _attention_class = "llama", KHALlamaAttention


class KHAMistralModel(KHAModel, MistralModel):
    _family, _attention_class = "mistral", KHAMistralAttention


class KHAQwen2Model(KHAModel, Qwen2Model):
    _family, _attention_class = "qwen2", KHAQwen2Attention


class KHAQwen3Model(KHAModel, Qwen3Model):
    _family, _attention_class = "qwen3", KHAQwen3Attention


class KHAQwen3MoeModel(KHAModel, Qwen3MoeModel):
    _family, _attention_class = "qwen3_moe", KHAQwen3MoeAttention


class KHAMixtralModel(KHAModel, MixtralModel):
    _family, _attention_class = "mixtral", KHAMixtralAttention


class KHALlamaForCausalLM(KHAForCausalLM, LlamaForCausalLM):
    _family, _body_class = "llama", KHALlamaModel


class KHAMistralForCausalLM(KHAForCausalLM, MistralForCausalLM):
    _family, _body_class = "mistral", KHAMistralModel


class KHAQwen2ForCausalLM(KHAForCausalLM, Qwen2ForCausalLM):
    _family, _body_class = "qwen2", KHAQwen2Model


class KHAQwen3ForCausalLM(KHAForCausalLM, Qwen3ForCausalLM):
    _family, _body_class = "qwen3", KHAQwen3Model


class KHAQwen3MoeForCausalLM(KHAForCausalLM, Qwen3MoeForCausalLM):
    _family, _body_class = "qwen3_moe", KHAQwen3MoeModel


class KHAMixtralForCausalLM(KHAForCausalLM, MixtralForCausalLM):
    _family, _body_class = "mixtral", KHAMixtralModel


KHAModel._family_classes = {c._family: c for c in KHAModel.__subclasses__()}
KHAForCausalLM._family_classes = {c._family: c for c in KHAForCausalLM.__subclasses__()}

# What the families declare about themselves (identical across the six in transformers 5.24, except the decoder
# layer names). The public classes advertise it, so code that inspects a class before building a model (the Auto
# classes, pipelines, Trainer, transformers' own model tests) sees what KHA supports; each concrete class then gets
# its family's own values back, since the public class comes first in its MRO.
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


def _advertise_family_attributes() -> None:
    for public in (KHAModel, KHAForCausalLM):
        concretes = list(public._family_classes.values())
        families = [concrete.__bases__[-1] for concrete in concretes]  # e.g. LlamaForCausalLM
        for name in _FAMILY_ATTRIBUTES:
            values = [getattr(family, name) for family in families]
            if all(value == values[0] for value in values):
                setattr(public, name, values[0])
        public._no_split_modules = sorted({layer for family in families for layer in family._no_split_modules})
        public.forward = families[0].forward  # the signature every family shares (MoE families add router outputs)
        for concrete, family in zip(concretes, families, strict=True):
            for name in (*_FAMILY_ATTRIBUTES, "_no_split_modules", "forward"):
                if name in public.__dict__:
                    setattr(concrete, name, getattr(family, name))


_advertise_family_attributes()


def _register_checkpoint_conversions() -> None:
    # transformers converts some families' on-disk layout at load (e.g. Mixtral's per-expert w1/w2/w3 into fused
    # expert tensors) and back at save, keyed by model_type, which for KHA is "kha". Register the family's mapping
    # under our class names so KHA models read and write exactly the base family's checkpoint layout.
    for public in (KHAModel, KHAForCausalLM):
        for family, concrete in public._family_classes.items():
            mapping = get_checkpoint_conversion_mapping(family)
            if mapping:
                register_checkpoint_conversion_mapping(concrete.__name__, mapping, overwrite=True)


_register_checkpoint_conversions()


def register_auto_classes(config_class: type) -> None:
    """Register KHA with transformers' Auto classes under CONFIG_CLASS: the public classes first (what
    `AutoModelForCausalLM` builds), then each family's concrete class, so that pipelines, which look an instance's
    class name up in the Auto mapping, recognise `KHAQwen3ForCausalLM` and its siblings as text-generation models."""
    from transformers import AutoModel, AutoModelForCausalLM

    for auto, public in ((AutoModel, KHAModel), (AutoModelForCausalLM, KHAForCausalLM)):
        auto.register(config_class, (public, *public._family_classes.values()), exist_ok=True)
