"""What a run checks on every rank as it starts, whatever engine shards it (DDP, FSDP2, DeepSpeed ZeRO-2/3):
the knocks' starting values and the weight decay their optimizer groups apply; and as it ends, that every rank
holds the same knocks.

Each rank gathers what it holds: an FSDP2 parameter is a DTensor (`full_tensor()`), a ZeRO-3 parameter is a
partition (`deepspeed.zero.GatheredParameters`), and ZeRO keeps the model's own parameters in its groups
(`bit16_groups` for stages 1-2, `fp16_groups` for stage 3) beside flat copies the inner optimizer steps.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from torch import nn
from transformers import TrainerCallback

from ..modeling.knocks import KnockLinear
from .params import is_knock_parameter


def _gathered(params: list[nn.Parameter]):
    if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3: every rank takes part in the gather
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def knock_start_error(model: nn.Module) -> float:
    """The largest |W - start| over every knock matrix (start: the identity, or zeros for an MLP knock's gate);
    0.0 exactly when the knocks are where KHA starts them. Collective under ZeRO-3: call it on every rank."""
    worst = 0.0
    for module in model.modules():
        if not isinstance(module, KnockLinear):
            continue
        with _gathered([module.weight]):
            weight = module.weight
            full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # FSDP2 / TP: a DTensor
            full = full.detach().to("cpu", torch.float64)
            start = torch.eye(full.shape[0], dtype=torch.float64) if module.start == "identity" else 0 * full
            worst = max(worst, (full - start).abs().max().item())
    return worst


def knock_decays(model: nn.Module, optimizer) -> set[float]:
    """The weight decays the optimizer applies to knock parameters (an empty set when it holds none)."""
    knock_ids = {id(p) for name, p in model.named_parameters() if is_knock_parameter(name)}
    inner = optimizer
    while inner is not None:
        # DeepSpeed ZeRO: the model's parameters, group by group (in the order of its param_groups)
        groups = getattr(inner, "bit16_groups", None) or getattr(inner, "fp16_groups", None)
        if groups is None and getattr(inner, "optimizer", None) is not None:
            inner = inner.optimizer  # accelerate's and DeepSpeed's wrappers hold the real one
            continue
        if groups is None and isinstance(inner, torch.optim.Optimizer):  # torch: each group holds its parameters
            groups = [group["params"] for group in inner.param_groups]
        if groups is None:
            break
        return {
            float(inner.param_groups[i]["weight_decay"])
            for i, params in enumerate(groups)
            if any(id(p) in knock_ids for p in params)
        }
    return set()


def engine_name(accelerator) -> str:
    """The engine accelerate actually runs, in words: what a config asked for is not always what runs (accelerate
    1.16 sets FSDP only for GPU-type runs: on CPUs an FSDP config trains with DDP)."""
    kind = getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))
    state = accelerator.state
    if kind == "DEEPSPEED":
        return f"DeepSpeed ZeRO-{state.deepspeed_plugin.zero_stage}"
    if kind == "FSDP":
        plugin = state.fsdp_plugin
        return f"FSDP{plugin.fsdp_version} ({getattr(plugin.state_dict_type, 'name', plugin.state_dict_type)})"
    return {"MULTI_CPU": "DDP (CPU)", "MULTI_GPU": "DDP", "NO": "one process"}.get(kind, kind)


class RankChecks(TrainerCallback):
    """At every start the main process prints the engine that runs (`engine: DeepSpeed ZeRO-3 on 2 process(es)`);
    at the first step of a new run every rank also reports its knocks' start and their weight decay, and the main
    process prints one line: `knocks at the start: identity on all N ranks; weight decay on knocks: [0.0]`.

    In multi-process runs, it checks at the end that every rank holds the same knocks (DDP and FSDP full-state runs
    must keep replicas identical); it prints one line saying so, or stops with an error naming the ranks that differ.

    It holds its trainer: Trainer hands callbacks the optimizer it had when it was built (None), not the one it
    makes at train time (transformers 5.25)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        import torch.distributed as dist

        model, optimizer = self.trainer.model, self.trainer.optimizer
        if state.is_world_process_zero:  # on every start, a resumed one too
            plan = getattr(self.trainer, "plan", None)  # sharded at load time by transformers (training/parallel.py)
            engine = plan.engine() if plan is not None else engine_name(self.trainer.accelerator)
            print(f"engine: {engine} on {args.world_size} process(es)")
        if model is None or state.global_step != 0:  # a resumed run's knocks have trained: no start to check
            return control
        if not any(isinstance(m, KnockLinear) for m in model.modules()):  # a baseline arm: nothing to check
            return control
        report = (knock_start_error(model), sorted(knock_decays(model, optimizer)) if optimizer is not None else None)
        reports = [report]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            reports = [None] * dist.get_world_size()
            dist.all_gather_object(reports, report)
        if state.is_world_process_zero:
            errors = [r[0] for r in reports]
            start = "identity" if max(errors) == 0 else f"trained (max |W - start| {max(errors):.3g})"
            decays = {tuple(r[1]) for r in reports if r[1] is not None}
            decay = ", ".join(str(list(d)) for d in sorted(decays)) if decays else "not known"
            print(f"knocks at the start: {start} on all {len(reports)} ranks; weight decay on knocks: {decay}")
        return control

    def on_train_end(self, args, state, control, model=None, **kwargs):
        import torch.distributed as dist

        if model is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return control
        digest = hashlib.sha256()
        for name, param in sorted(model.named_parameters()):
            if is_knock_parameter(name):
                full = param.full_tensor() if hasattr(param, "full_tensor") else param  # DTensor under FSDP2 / TP
                digest.update(name.encode())
                digest.update(full.detach().to("cpu", torch.float64).numpy().tobytes())
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest.hexdigest())
        if len(set(digests)) != 1:
            raise RuntimeError(f"knocks differ across ranks: {digests}")
        if state.is_world_process_zero:
            print(f"knocks identical on all {len(digests)} ranks (sha256 {digests[0][:12]})")
        return control
