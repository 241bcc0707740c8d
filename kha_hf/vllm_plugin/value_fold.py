"""KHA-MLP value knocks with their down map folded into o_proj while vLLM loads the weights.

An MLP value knock is `V~ = 2 (V Uᵀ * sigmoid(V Gᵀ)) Dᵀ` per head (U, G, D: the nn.Linear weights of the knock's
up, gate and down maps, shared by every head; `knocks.MLPKnock`). Its last map acts on the value features of each
head, and attention is linear in V (the softmax weights mix tokens, never features; sinks change only the weights):
`P V~ = (P glu) (2 D)ᵀ`. So 2 D folds into the output projection's input columns of every query head,
`W_o[:, h] <- W_o[:, h] 2 D`, and the knock runs as two kernels (`GatedUpKnock`: one matmul for [U; G], torch's
`glu`) instead of three (`models.GLUKnock`) or the six of the module as written.

Why not also fold U and G into the value projection (its value rows per head would become [U W_h; G W_h]), leaving
one `glu`: that makes the value projection twice as wide, n_kv d hidden more weights per layer (+3 % of SmolLM2's
layer weights, +2 % of Llama-3-8B's), and decoding at small batches reads every weight once per step: it is bound
by weight bytes, which this fold leaves exactly as the base's. Folding changes float rounding only (float64 products,
cast back): the tests hold vLLM's tokens equal to transformers' and its log-probabilities within the backend tests'
tolerance.

Used only where all of this is known to hold (`foldable`); elsewhere the knock runs as `models.GLUKnock`.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling.families import FAMILIES
from . import TAG

# The family's attention feeds the attention output, only reshaped, to o_proj: nothing (an output gate, Qwen3-Next)
# acts on the per-head features between the kernel and o_proj, so the down map can move into o_proj.
_OUTPUT_PATTERN = re.compile(
    r"attn_output = attn_output\.reshape\([^\n]*\)(?:\.contiguous\(\))?\n\s*attn_output = self\.o_proj\(attn_output\)"
)


def plain_site(path: str) -> str:
    """A text model's checkpoint module path -> its path in vLLM's HF body (`model.layers.3.self_attn` ->
    `layers.3.self_attn`). The site must follow the body's prefix exactly (`model.` or nothing), never another
    tower's `...layers.3...`."""
    return path.removeprefix("model.")


_PROBE = "kha_site_probe"  # a leaf name no mapping rule knows


def mapped_site(mapper):
    """A checkpoint module path -> its path in vLLM's HF body, as vLLM's weights MAPPER (`hf_to_vllm_mapper`) maps
    the names under it: a multimodal checkpoint's `language_model.model.layers.3.self_attn` ->
    `language_model.layers.3.self_attn` (Gemma 3's renaming, vLLM 0.32). Only the path is mapped: the mapper's
    fused-projection rules rename leaves (`q_proj` -> `qkv_proj`), which would hide which projection a tensor is."""

    def site(path: str) -> str:
        mapped = mapper.map_name(f"{path}.{_PROBE}")
        return plain_site(path if mapped is None else mapped.removesuffix(f".{_PROBE}"))

    return site


class GatedUpKnock(nn.Module):
    """An MLP value knock whose down map is folded into o_proj: (..., d) -> (..., d) = glu(x [U; G]ᵀ). Plain buffers,
    replicated on every tensor-parallel rank, as the knock is (it acts on each head's d features)."""

    def __init__(self, up: torch.Tensor, gate: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("up_gate", torch.cat([up, gate]), persistent=False)  # (2d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.glu(F.linear(x, self.up_gate), dim=-1)


@functools.cache
def _family_forward_source(cls: type) -> str | None:
    """The source of the forward of the transformers attention class under CLS (a KHA attention class), read once
    per class (every layer of a model shares it); None if there is none or it cannot be read."""
    family = next((c for c in cls.__mro__ if c.__module__.startswith("transformers.models.")), None)
    try:
        return inspect.getsource(family.forward)
    except (TypeError, OSError, AttributeError):
        return None


def foldable(config, attention: nn.Module, quantized: bool) -> bool:
    """Whether ATTENTION (a KHA attention module as vLLM built it) can take its MLP value knock's down map into
    o_proj: a value projection that holds the value heads alone, an o_proj right after the kernel, float weights."""
    if quantized or config.knock_v != "mlp":
        return False
    plan = getattr(attention, "_kha_plans", {}).get("v_proj")
    if plan is None or len(plan) != 1 or plan[0][2] != ((plan[0][1], "v_knock"),):
        return False  # the value projection holds more than the value heads (fused qkv on disk, MLA segments)
    if not isinstance(getattr(attention, "o_proj", None), nn.Module):
        return False
    if config.base_model_type not in FAMILIES:
        return False  # a family outside the table (tried with the standard layout): its code was never read here
    source = _family_forward_source(type(attention))
    if source is None:
        return False
    # Nothing may act on the values between the knock and the kernel: a norm, or a clamp (OLMo's clip_qkv)
    touched = any(word in source for word in ("v_norm", "clamp", "clip_qkv"))
    return bool(_OUTPUT_PATTERN.search(source)) and not touched


class ValueKnockFolder:
    """Folds the down map of the MLP value knocks of the layers at SITES (attention module path -> layer index) into
    their o_proj while the checkpoint's tensors stream past (an o_proj weight waits until its layer's down map has
    arrived), and keeps the up and gate maps for `install`. Every tensor also goes on to vLLM's loader, which fills
    the knock modules it built; `install` then swaps them."""

    PARTS = ("up", "gate", "down")

    def __init__(self, sites: dict[str, int], head_dim: int, site=plain_site) -> None:
        self.sites = sites
        self.site = site  # a checkpoint module path -> its path in vLLM's HF body
        self.head_dim = head_dim  # d: each knock map is a float (d, d) matrix
        self.knocks: dict[str, dict[str, torch.Tensor]] = {}  # site -> part -> (d, d) weight
        self.waiting: dict[str, tuple[torch.Tensor, str]] = {}  # o_proj weight name -> (tensor, site)
        self.folded: set[str] = set()  # sites whose o_proj weight went out folded
        self.installed = False

    def _locate(self, name: str) -> tuple[str | None, str]:
        """(site, what) of `model.layers.3.self_attn.v_knock.up.weight` ("up") or `...o_proj.weight` ("o_proj"),
        else (None, "")."""
        for part in self.PARTS:
            suffix = f".v_knock.{part}.weight"
            if name.endswith(suffix):
                site = self.site(name.removesuffix(suffix))
                return (site, part) if site in self.sites else (None, "")
        site = self.site(name.removesuffix(".o_proj.weight"))
        return (site, "o_proj") if name.endswith(".o_proj.weight") and site in self.sites else (None, "")

    def _knock(self, name: str, tensor: torch.Tensor, site: str, part: str) -> None:
        d = self.head_dim
        if not tensor.is_floating_point() or tuple(tensor.shape) != (d, d):
            raise ValueError(
                f"KHA checkpoint refused: {name} ({tensor.dtype}, shape {tuple(tensor.shape)}) is not an MLP knock's "
                f"weight, which is a float ({d}, {d}) matrix"
            )
        knocks = self.knocks.setdefault(site, {})
        if part in knocks:
            raise ValueError(f"KHA checkpoint refused: {name} is stored twice")
        knocks[part] = tensor

    def _fold(self, name: str, weight: torch.Tensor, site: str) -> torch.Tensor:
        """o_proj's weight (hidden, n_heads d) with every head's columns times 2 D, in float64."""
        d = self.head_dim
        if not weight.is_floating_point() or weight.dim() != 2 or weight.shape[1] % d:
            raise ValueError(
                f"KHA checkpoint refused: the MLP value knock's down map cannot be folded into {name} "
                f"({weight.dtype}, shape {tuple(weight.shape)}): it folds only into a float (hidden, heads x {d})"
            )
        self.folded.add(site)
        heads = weight.double().unflatten(1, (-1, d))  # (hidden, n_heads, d)
        folded = heads @ (2 * self.knocks[site]["down"].double())
        return folded.flatten(1).to(torch.promote_types(weight.dtype, torch.float32))  # vLLM casts to its dtype

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        if self.installed:  # a later load (vLLM's reload_weights, a weight update): the folded layers cannot take it
            for name, tensor in weights:
                if self._locate(name)[0] is not None:
                    raise ValueError(
                        f"{TAG}: {name} cannot be reloaded: this layer's MLP value knock was folded into its "
                        "o_proj at load; load the model again instead"
                    )
                yield name, tensor
            return
        for name, tensor in weights:
            site, what = self._locate(name)
            if site is None:
                yield name, tensor
            elif what in self.PARTS:
                self._knock(name, tensor, site, what)
                yield name, tensor
                held = [n for n, (_, s) in self.waiting.items() if s == site]
                if what == "down" and held:
                    yield held[0], self._fold(held[0], self.waiting.pop(held[0])[0], site)
            elif "down" in self.knocks.get(site, {}):
                yield name, self._fold(name, tensor, site)
            else:
                self.waiting[name] = (tensor, site)
        incomplete = [s for s in self.sites if len(self.knocks.get(s, {})) != len(self.PARTS)]
        unfolded = [s for s in self.sites if s not in self.folded and s not in incomplete]
        if unfolded:  # vLLM itself would serve an uninitialised o_proj (it does not check unquantized linears)
            raise ValueError(
                f"KHA checkpoint refused: {unfolded[0]}.o_proj.weight is missing from the checkpoint (layer "
                f"{self.sites[unfolded[0]]})"
            )
        if incomplete:
            missing = [p for p in self.PARTS if p not in self.knocks.get(incomplete[0], {})]
            raise ValueError(
                f"KHA checkpoint refused: {incomplete[0]}.v_knock has no {'/'.join(missing)} weight in the checkpoint "
                f"(config.json says knock_v is mlp in layer {self.sites[incomplete[0]]})"
            )

    def install(self, model: nn.Module) -> int:
        """Swap the value knock of every folded layer of MODEL (vLLM's HF body) for its `GatedUpKnock`, on the
        device and dtype of the module it replaces; how many."""
        for site, parts in self.knocks.items():
            attention = model.get_submodule(site)
            reference = next(attention.v_knock.parameters())
            attention.v_knock = GatedUpKnock(parts["up"], parts["gate"]).to(reference.device, reference.dtype)
        count = len(self.knocks)
        self.knocks.clear()
        self.installed = True
        return count
