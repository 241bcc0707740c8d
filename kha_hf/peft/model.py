"""`KnockModel`: the PEFT tuner that puts knock adapters (`KnockLayer`) on a stock model's q/k/v projections.

Where the knocks go is KHA's own table (`modeling/families.py`): the family's projections in each knocked layer
(every softmax-attention layer unless `knock_layers` says otherwise), with the same per-head layout and sizes as
`KHAForCausalLM`, so an adapter's knocks are exactly the knocks a KHA model of that base would hold.
"""

from __future__ import annotations

import contextlib
import re
import reprlib
import zlib
from collections.abc import Iterable
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTuner
from peft.utils import AuxiliaryTrainingWrapper
from torch import nn

from ..checkpoint.checks import check_knocks_fit
from ..modeling.families import (
    FAMILIES,
    attention_layers,
    family_spec,
    knock_dims,
    knock_plan,
    projection_features,
)
from .config import KnockConfig
from .layer import KnockLayer

KNOCK_ADAPTER_TAGS = ["kha-hf", "knocking-heads-attention", "knock-adapter"]
# peft >= 0.21 lets a tuner name its tensors in the file (`_remove_adapter_name_from_key`) and check a file before it
# loads (`_remap_adapter_state_dict_for_load`). peft 0.20 (Axolotl 0.19's pin) has neither: kha_hf/peft/compat.py
# gives knock adapters the same file format and checks there.
REMAP_HOOK = hasattr(BaseTuner, "_remap_adapter_state_dict_for_load")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.[^.]+\.([^.]+)$")  # ...layers.<i>.<attention>.<projection>


def saved_module_keys(model: nn.Module, adapter_name: str, *, in_file: bool) -> set[str]:
    """The keys of ADAPTER_NAME's own copies of its modules_to_save (peft's wrappers, `AuxiliaryTrainingWrapper`), as
    peft maps them (`adapter_state_dict_load_map`, peft 0.20 and 0.21): as the model names them
    (`base_model.model.lm_head.modules_to_save.<ADAPTER_NAME>.weight`) or, IN_FILE, as the file holds them
    (`base_model.model.lm_head.weight`). Nothing else of a wrapper is the adapter's: not `original_module` (the base
    model's own module), not `base_layer`, not another adapter's copy."""
    keys = set()
    for name, module in model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            for stored, loaded in module.adapter_state_dict_load_map(adapter_name).items():
                keys.add(f"{name}.{stored if in_file else loaded}")
    return keys


def check_knock_state_dict(
    model_state: dict[str, torch.Tensor],
    given_state: dict[str, torch.Tensor],
    adapter_name: str,
    saved_modules: set[str],
) -> None:
    """ValueError (one line) unless GIVEN_STATE (an adapter file's tensors, its knocks under the model's names with the
    adapter name in them) holds exactly ADAPTER_NAME's knocks of MODEL_STATE, finite floating point of the same shapes,
    plus only keys of SAVED_MODULES (`saved_module_keys`: this adapter's own copies of its modules_to_save)."""
    expected = {key: t for key, t in model_state.items() if f".knock_sets.{adapter_name}." in key}
    given = {key: tensor for key, tensor in given_state.items() if ".knock_sets." in key}
    # Anything else must be exactly a key peft maps to this adapter's own copy of a module: peft loads the rest into
    # the model as it stands (strict=False), so one extra `lm_head.weight`, `lm_head.original_module.weight` or
    # `lm_head.modules_to_save.<another adapter>.weight` would replace the base model's weights, or a neighbour's.
    others = sorted(key for key in given_state if key not in given and key not in saved_modules)
    if others:
        raise ValueError(
            f"knock adapter {adapter_name!r} holds {len(others)} tensors that are neither knocks nor its own copies of "
            f"the modules its modules_to_save names: {others[:2]} (they would replace the base model's weights or "
            "another adapter's)"
        )
    for key, tensor in given_state.items():  # the modules_to_save tensors too: NaN there made every logit NaN
        # .float(): torch.isfinite has no float8 kernel
        if key not in given and tensor.is_floating_point() and not torch.isfinite(tensor.float()).all():
            raise ValueError(f"knock adapter {adapter_name!r}: {key} holds NaN or infinite values")
    check_knocks_fit(
        {key: tuple(tensor.shape) for key, tensor in expected.items()},
        given,
        lambda missing, extra: ValueError(
            f"knock adapter {adapter_name!r} does not fit this model: {len(missing)} knock tensors missing "
            f"{missing[:2]}, {len(extra)} unexpected {extra[:2]}"
        ),
        lambda key, shape, needed: ValueError(
            f"knock adapter {adapter_name!r}: {key} has shape {shape}, this model's knock {needed} "
            "(an adapter of another model size)"
        ),
    )
    for key, tensor in given.items():
        # float8 knocks are refused too: the knock's matmul has no float8 kernel (and isfinite none either)
        if tensor.dtype.itemsize < 2 or not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise ValueError(f"knock adapter {adapter_name!r}: {key} is not finite floating point ({tensor.dtype})")


def _adapter_names_pre_forward_hook(
    module: nn.Module, args: tuple, kwargs: dict, adapter_names: list[str], tuner: KnockModel, held: set | None
):
    """A forward pre-hook that hands ADAPTER_NAMES (one per row) to a knock layer or modules_to_save wrapper, as
    peft's LoRA hook does. Rows of an adapter the wrapper does not hold (HELD: its adapters; None: any) run its base
    module. Inside `generate`, which repeats each row (beam search, num_return_sequences; from its keywords or any
    generation config), each name is repeated alike."""
    names = [name if held is None or name in held else "__base__" for name in adapter_names]
    rows = len(args[0]) if args and isinstance(args[0], torch.Tensor) else len(names)
    if tuner._generating and rows != len(names) and rows % len(names) == 0:
        names = [name for name in names for _ in range(rows // len(names))]  # generate's repeat_interleave
    kwargs["adapter_names"] = names
    return args, kwargs


INIT_PERTURBATION = 0.02  # init_weights=False: the knocks' distance from the identity (each entry's std)


def perturb_knocks(knocks: nn.Module, module_name: str, adapter_name: str = "default") -> None:
    """`init_weights=False`: add seeded noise (std INIT_PERTURBATION) to every knock parameter of KNOCKS, the seed
    taken from MODULE_NAME and ADAPTER_NAME, so the same model, config and adapter name always give the same adapter,
    and two adapters of one model differ; linear knocks stay invertible (I + small noise), the MLP gate leaves 0."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{module_name}/{adapter_name}".encode()))
    with torch.no_grad():
        for param in knocks.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_((INIT_PERTURBATION * noise).to(param.dtype).to(param.device))


def knock_placements(model: nn.Module, config: KnockConfig) -> dict[str, dict[str, Any]]:
    """module name -> what its `KnockLayer` needs (types, dims, blocks, plan), for every projection that takes a
    knock of CONFIG in MODEL. Refuses (ValueError, one line) a family, layer list or projection size that does not
    fit."""
    model_config = getattr(model, "config", None)
    model_type = getattr(model_config, "model_type", None)
    if model_type == "kha":
        raise ValueError(
            "this model is a KHA model and has knocks already: train them directly (kha train, or any trainer with "
            "kha_hf.optimizer_param_groups), or load its base checkpoint for a knock adapter"
        )
    if model_type not in FAMILIES:
        raise ValueError(
            f"a knock adapter needs a model of a family KHA supports; {model_type!r} is not one of: "
            f"{', '.join(FAMILIES)}"
        )
    if config.base_model_type is not None and config.base_model_type != model_type:
        raise ValueError(f"this knock adapter was made for a {config.base_model_type} model, not {model_type}")
    spec = family_spec(model_type)
    types = config.knock_types
    if spec.linear_only and any(kind != "linear" for kind in types.values()):
        raise ValueError(
            f"{model_type} uses multi-head latent attention (MLA), which takes linear knocks only "
            "(linear_q, linear_k, linear_v, linear_qkv)"
        )
    view = SimpleNamespace(**model_config.to_dict())  # sizes as KHAConfig reads them (head_dim defaults included)
    dims = knock_dims(view, spec.layout)
    types = {target: kind for target, kind in types.items() if target in dims}
    softmax_layers = attention_layers(view)
    layers = softmax_layers if config.knock_layers is None else config.knock_layers
    bad = [i for i in layers if i not in softmax_layers]
    if bad:
        raise ValueError(
            f"knock_layers {bad[:5]} are not softmax-attention layers of this {model_type} model "
            f"({view.num_hidden_layers} layers; attention layers {softmax_layers[:3]}...)"
        )
    placements, found = {}, set()
    for name, module in model.named_modules():
        match = _LAYER.search(name)
        if not match or "vision" in name or "visual" in name:
            continue
        layer, projection = int(match.group(1)), match.group(2)
        if projection not in spec.layout or layer not in layers:
            continue
        blocks = spec.layout[projection]
        expected = projection_features(view, blocks)
        if isinstance(module, KnockLayer):
            module = module.get_base_layer()  # a second adapter on the same projection
        if not isinstance(module, nn.Linear) or module.out_features != expected:
            raise ValueError(
                f"{model_type}: {name} is {type(module).__name__} with {getattr(module, 'out_features', '?')} output "
                f"features, the knock layout expects a linear projection with {expected}: this attention does not fit"
            )
        plan = knock_plan(view, blocks, set(types))
        if plan is None:
            continue  # e.g. k_proj under linear_v
        held = {s.target for block in blocks for s in block.segments} & set(types)
        placements[name] = {
            "types": {t: types[t] for t in held},
            "dims": dims,
            "config": view,
            "blocks": blocks,
            "plan": plan,
        }
        found.add(layer)
    missing = sorted(set(layers) - found)
    if missing:
        raise ValueError(f"{model_type}: no q/k/v projections found in layers {missing[:5]}: this model does not fit")
    return placements


# The head names PEFT adds to modules_to_save for a task type (peft_model.PeftModelForSequenceClassification, ...,
# peft 0.21), whichever of them the model has: for those task types, one the model lacks is not the user's mistake.
PEFT_TASK_HEADS = {  # peft 0.22 adds pre_classifier (DistilBERT's) to the classification heads
    "SEQ_CLS": ("classifier", "score", "pre_classifier"),
    "TOKEN_CLS": ("classifier", "score", "pre_classifier"),
    "QUESTION_ANS": ("qa_outputs",),
}


def names_module(name: str, entry: str) -> bool:
    """Whether a modules_to_save ENTRY names the module NAME, by the installed PEFT's rule (utils.other._set_trainable):
    NAME ends with ENTRY, and from peft 0.22 at a name boundary ("norm" names `model.norm`, no longer
    `model.layers.0.input_layernorm`)."""
    if not name.endswith(entry):
        return False
    return not _PEFT_NAME_BOUNDARY or len(name) == len(entry) or name.endswith("." + entry)


def _name_boundary() -> bool:
    import peft
    from packaging.version import Version

    return Version(peft.__version__) >= Version("0.22.0.dev0")


_PEFT_NAME_BOUNDARY = _name_boundary()
# Parts of PEFT's own wrappers (a knocked projection's base layer, a modules_to_save wrapper's copies): not modules
# a user trains in full.
_WRAPPER_PARTS = (".base_layer.", ".original_module.", ".modules_to_save.")


def check_modules_to_save(model: nn.Module, config: KnockConfig, knocked: Iterable[str]) -> None:
    """ValueError (one line) for a `modules_to_save` entry of CONFIG that names no module of MODEL, or one that names
    a module that is, holds or lies inside a projection that carries a knock (KNOCKED: of this adapter or any other
    of MODEL): PEFT would then save nothing for it, or train that module in full and silently drop its layer's knock
    (or copy another adapter's knock into the wrapper), or fail with an error about `target_modules`."""
    task = getattr(config.task_type, "value", config.task_type)
    exempt = PEFT_TASK_HEADS.get(task, ()) if isinstance(task, str) else ()
    names = [name for name, _ in model.named_modules(remove_duplicate=False)]
    knocked = list(knocked)
    for entry in config.modules_to_save or ():
        shown = reprlib.repr(entry)
        matched = [  # peft's rule (utils.other._set_trainable, names_module)
            name
            for name in names
            if entry and names_module(name, entry) and not any(p in f".{name}." for p in _WRAPPER_PARTS)
        ]
        if not matched and entry not in exempt:
            raise ValueError(f"modules_to_save [{shown}] names no module of this model")
        for module in matched:
            clash = [p for p in knocked if p == module or p.startswith(f"{module}.") or module.startswith(f"{p}.")]
            if clash:
                raise ValueError(
                    f"modules_to_save [{shown}] would train {module} in full, and {clash[0]} carries a knock: a "
                    "module takes knocks or full training, not both"
                )


def check_file_saves_its_modules(model: nn.Module, config: KnockConfig) -> None:
    """ValueError (one line) when CONFIG was read from a local adapter folder (`KnockConfig.from_pretrained`) whose
    adapter_model.safetensors lacks a tensor of a module its modules_to_save names in MODEL: peft 0.21 would fail
    later with a bare `KeyError: 'base_model.model.lm_head.weight'`. Runs before any weight is read."""
    folder = getattr(config, "loaded_from", None)
    path = None if folder is None else folder / "adapter_model.safetensors"
    if not config.modules_to_save or path is None or not path.is_file():
        return
    from ..checkpoint.safetensors_index import read_header

    held = set(read_header(path))
    for name, module in model.named_modules(remove_duplicate=False):
        if any(p in f".{name}." for p in _WRAPPER_PARTS):
            continue
        if any(entry and names_module(name, entry) for entry in config.modules_to_save):
            if isinstance(module, AuxiliaryTrainingWrapper):  # another adapter's copy: the file holds the module's own
                module = getattr(module, "original_module", module)
            missing = [f"base_model.model.{name}.{key}" for key in module.state_dict()]
            missing = [key for key in missing if key not in held]
            if missing:
                raise ValueError(
                    f"{path} has no tensor {missing[0]} of {name}, a module its modules_to_save names (saved by "
                    "another model, or cut short)"
                )


class KnockModel(BaseTuner):
    """Knock adapters on a stock transformers model (see `KnockConfig`); built by `peft.get_peft_model`."""

    prefix: str = "knock_"
    tuner_layer_cls = KnockLayer
    target_module_mapping: dict = {}

    def __init__(self, model: nn.Module, config: Any, adapter_name: str, *args: Any, **kwargs: Any) -> None:
        # PeftModel (get_peft_model, PeftModel.from_pretrained) passes {adapter_name: config}, peft 0.20 and 0.21;
        # peft's inject_adapter_in_model passes the config alone. transformers' `model.load_adapter(DIR)` and
        # `model.add_adapter(config)` (5.16 to 5.25) go that way, then load the adapter file with their own loader,
        # which no tuner hook sees: an extra `lm_head.weight` in the file replaced the base model's in silence.
        if not isinstance(config, dict):
            raise ValueError(
                "knock adapters load through PEFT only: PeftModel.from_pretrained(model, DIR) (or get_peft_model), "
                "not transformers' model.load_adapter / add_adapter or peft's inject_adapter_in_model, which load an "
                "adapter file's tensors without kha's checks"
            )
        super().__init__(model, config, adapter_name, *args, **kwargs)

    def _post_injection_hook(self, model: nn.Module, config: KnockConfig, adapter_name: str) -> None:
        # Tags of the adapter's model card (peft reads the base model's): they name the package that provides the
        # KNOCK type, which a user without kha-hf needs (peft 0.21 then fails with KeyError: 'KNOCK').
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(KNOCK_ADAPTER_TAGS)

    def _prepare_adapter_config(self, peft_config: KnockConfig, model_config: dict) -> KnockConfig:
        # The targets are derived, never taken from the config: an adapter file cannot put knocks elsewhere.
        placements = knock_placements(self.model, peft_config)
        every_adapter = {**getattr(self, "_knock_placements", {}), **placements}
        check_modules_to_save(self.model, peft_config, every_adapter)
        check_file_saves_its_modules(self.model, peft_config)
        peft_config.base_model_type = self.model.config.model_type
        self._knock_placements = every_adapter
        peft_config.target_modules = "|".join(re.escape(name) for name in sorted(placements))
        return peft_config

    def _create_and_replace(
        self,
        peft_config: KnockConfig,
        adapter_name: str,
        target: nn.Module,
        target_name: str,
        parent: nn.Module,
        current_key: str,
        **kwargs: Any,
    ) -> None:
        placement = self._knock_placements[current_key]
        if isinstance(target, KnockLayer):
            target.update_layer(adapter_name, placement, inference_mode=peft_config.inference_mode)
            layer = target
        else:
            layer = KnockLayer(target, adapter_name, placement)
            if adapter_name not in self.active_adapters:
                layer.requires_grad_(False)  # an added adapter is not trainable until it is set active
            self._replace_module(parent, target_name, layer, target)
        if not peft_config.init_weights:
            perturb_knocks(layer.knock_sets[adapter_name], current_key, adapter_name)

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        # `...q_proj.knock_sets.<adapter>.q_knock.weight` -> `...q_proj.knock_sets.q_knock.weight`: the file does not
        # depend on the name the adapter had (peft's default strips only a second-to-last name)
        return key.replace(f".knock_sets.{adapter_name}.", ".knock_sets.", 1)

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: KnockConfig, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """As peft does, then refuse (one line, before any tensor is loaded) a file whose knocks are missing, extra,
        of other shapes, not floating point, or not finite: peft itself would load what fits and warn."""
        remapped = super()._remap_adapter_state_dict_for_load(model, config, adapter_name, state_dict)
        saved = saved_module_keys(model, adapter_name, in_file=False)  # peft has translated their keys by now
        check_knock_state_dict(model.state_dict(), remapped, adapter_name, saved)
        return remapped

    @contextlib.contextmanager
    def _enable_peft_forward_hooks(self, *args: Any, **kwargs: Any):
        """PEFT calls this around forward and generate with their special arguments. `adapter_names=` (one adapter
        name per row, "__base__" for none) runs a mixed adapter batch: each knock layer, and each modules_to_save
        wrapper, gets the list through a forward pre-hook, as PEFT's LoRA does (`LoraModel._enable_peft_forward_hooks`,
        peft 0.21), with PEFT's own errors."""
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is None:
            yield
            return
        if not isinstance(adapter_names, (list, tuple)) or not all(isinstance(n, str) for n in adapter_names):
            # a string would be read one character per row
            raise TypeError(f"Got adapter names of type {type(adapter_names)}, expected a list of str.")
        if self.training:
            raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
        # one layer may lack an adapter (linear_v has no knock on k_proj): an adapter must be somewhere in the model
        expected = {name for module in self.modules() if isinstance(module, KnockLayer) for name in module.knock_sets}
        unexpected = {name for name in adapter_names if name != "__base__"} - expected
        if unexpected:
            raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unexpected))}")
        handles = []
        for module in self.modules():
            if isinstance(module, (KnockLayer, AuxiliaryTrainingWrapper)):
                saved = getattr(module, "modules_to_save", None)  # PEFT's wrapper: the adapters it holds a copy for
                held = set(saved.keys()) if isinstance(module, AuxiliaryTrainingWrapper) and saved is not None else None
                inject = partial(
                    _adapter_names_pre_forward_hook, adapter_names=list(adapter_names), tuner=self, held=held
                )
                handles.append(module.register_forward_pre_hook(inject, with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    _generating = False  # True inside generate(): the hook then follows generate's repetition of rows

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward; `adapter_names=` is honoured here too (PEFT's BaseTuner.forward would drop it
        and run the active adapter on every row)."""
        with self._enable_peft_forward_hooks(*args, **kwargs):
            kwargs.pop("adapter_names", None)
            return self.model.forward(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's generate (PeftModel.generate calls this inside `_enable_peft_forward_hooks`)."""
        self._generating = True
        try:
            return self.model.generate(*args, **kwargs)
        finally:
            self._generating = False

    def _check_merge_allowed(self) -> None:
        super()._check_merge_allowed()
        for name in self.active_adapters:
            for module in self.model.modules():
                if isinstance(module, KnockLayer) and name in module.knock_sets:
                    module._fold_rows(name)  # one line for MLP or non-finite knocks, before any weight changes
