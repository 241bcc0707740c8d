"""The parallel layout of a `kha train` run: one value, read and checked once, and the one place that shards a model.

Route: transformers' own distributed loading (`from_pretrained(..., distributed_config=DistributedConfig(...))`,
transformers >= 5.25). It builds the model on the meta device, applies the family's plans (tensor, expert, then
FSDP2 per decoder layer, as torchtitan does) and has each rank read only its shard of the checkpoint; the Trainer
then trains the model as it is (`is_distributed_loading_by_transformers`: no second wrap). The same calls run on
CPU ranks (gloo) and on GPUs, so the CPU tests run the code a GPU runs. accelerate 1.16 applies its own FSDP plugin
only to GPU runs; kha train takes an accelerate FSDP2 config (`examples/accelerate/fsdp2-*.yaml`) as its plan and
turns accelerate's plugin off, so that on every device the model is sharded once, by transformers.

Layouts: FSDP2 (an accelerate config with `fsdp_version: 2`), tensor parallelism (`--tp-size`) and expert
parallelism (`--ep-size`), on the world size of the launch; what the world size does not divide is refused in one
line before anything loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.errors import KHAError

STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")


def _env_flag(name: str, default: str = "false") -> bool:
    """A flag accelerate launch set, read as accelerate reads it (y/yes/t/true/on/1, n/no/f/false/off/0)."""
    from accelerate.utils import str_to_bool

    value = os.environ.get(name, default).strip()
    try:
        return bool(str_to_bool(value))
    except ValueError:
        raise KHAError(f"{name}={value!r} is not a true/false value") from None


@dataclass(frozen=True)
class ParallelPlan:
    """How the ranks of a run hold the model. FSDP_SIZE x TP_SIZE = WORLD_SIZE; EP_SIZE divides it.

    STATE_DICT_TYPE: how checkpoints are written under FSDP2: FULL (one gathered `model.safetensors`, as a plain
    save) or SHARDED (each rank writes its shard, `save_pretrained(distributed_checkpoint=True)`). The final model
    is always saved whole, so `from_pretrained` loads it anywhere."""

    world_size: int
    fsdp_size: int = 1
    tp_size: int = 1
    ep_size: int = 1
    state_dict_type: str = "FULL_STATE_DICT"

    @property
    def data_parallel_size(self) -> int:
        """The ranks that each read a distinct batch (TP ranks share theirs)."""
        return self.fsdp_size

    @property
    def sharded_checkpoints(self) -> bool:
        return self.state_dict_type == "SHARDED_STATE_DICT"

    def layout(self) -> dict:
        """What a checkpoint of this run records and a resume must match (training/run_state.py)."""
        return {
            "world_size": self.world_size,
            "fsdp_size": self.fsdp_size,
            "tp_size": self.tp_size,
            "ep_size": self.ep_size,
            "state_dict_type": self.state_dict_type,
        }

    def engine(self) -> str:
        """The engine line's words: what shards the model."""
        parts = []
        if self.fsdp_size > 1:
            parts.append(f"FSDP2 ({self.state_dict_type})")
        if self.tp_size > 1:
            parts.append(f"TP {self.tp_size}")
        if self.ep_size > 1:
            parts.append(f"EP {self.ep_size}")
        return " + ".join(parts) + ", sharded at load by transformers' DistributedConfig"

    def distributed_config(self):
        from transformers.distributed import DistributedConfig

        layout = {"fsdp_size": self.fsdp_size, "tp_size": self.tp_size}
        if self.tp_size > 1:
            layout["tp_plan"] = "auto"
        elif self.ep_size > 1:
            layout["tp_plan"] = {}  # the expert plan alone: dense layers are FSDP-sharded or replicated
        if self.ep_size > 1:
            layout["ep_size"] = self.ep_size
        return DistributedConfig(**layout)


def world_size() -> int:
    """Processes of an `accelerate launch` / torchrun run, read before any process group is set up."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_distributed_loading() -> None:
    """One line unless this transformers shards at load time (`transformers.distributed.DistributedConfig`, 5.25)."""
    import transformers

    try:
        from transformers.distributed import DistributedConfig  # noqa: F401
        from transformers.distributed.checkpoint import load_optimizer_distributed  # noqa: F401
    except ImportError:
        raise KHAError(
            f"FSDP2, tensor and expert parallelism in kha train need transformers >= 5.25 (DistributedConfig); this "
            f"is {transformers.__version__}: pip install -U transformers"
        ) from None


def plan_from_launch(tp_size: int | None = None, ep_size: int | None = None) -> ParallelPlan | None:
    """The run's layout from what `accelerate launch` set (its FSDP2 config) and the --tp-size / --ep-size flags;
    None for a run that shards nothing here (one process, DDP, DeepSpeed). One-line KHAError for a layout the world
    size does not divide, or an FSDP option kha cannot honour."""
    world = world_size()
    fsdp = _env_flag("ACCELERATE_USE_FSDP")
    tp, ep = 1 if tp_size is None else tp_size, 1 if ep_size is None else ep_size
    for name, size in (("--tp-size", tp), ("--ep-size", ep)):
        if size < 1:
            raise KHAError(f"{name} must be a positive integer, got {size}")
        if size > 1 and world % size:
            raise KHAError(f"{name} {size} does not divide the {world} process(es) of this launch")
    if not fsdp and tp == 1 and ep == 1:
        return None
    if tp > 1 and not torch.cuda.is_available():
        # Trainer hands a TP model's layout to accelerate as a ParallelismConfig, which accelerate 1.16 accepts only
        # for GPU-type runs (MULTI_CPU is refused): tensor-parallel logits run on CPU ranks, training does not
        raise KHAError("--tp-size trains on GPUs only: accelerate 1.16 refuses tensor parallelism in CPU runs")
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        asked = "an FSDP config" if fsdp else "--tp-size / --ep-size"
        raise KHAError(f"{asked} and DeepSpeed both shard the model: launch with one of them")
    if world < 2:
        raise KHAError("a parallel layout needs several processes: start the run with accelerate launch")
    state_dict_type = "FULL_STATE_DICT"
    if fsdp:
        state_dict_type = _check_fsdp_options()
    if tp > 1 and ep > 1 and ep != tp:
        raise KHAError(f"--ep-size {ep} with --tp-size {tp}: kha train runs expert parallelism over the TP ranks")
    return ParallelPlan(world, fsdp_size=world // tp, tp_size=tp, ep_size=ep, state_dict_type=state_dict_type)


def _check_fsdp_options() -> str:
    """The accelerate FSDP options kha honours (version 2, where every rank reads its own shard, with or without
    `fsdp_cpu_ram_efficient_loading`: loading is always low-memory); the state dict type they ask for."""
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise KHAError(f"fsdp_version {version} is not offered: kha train runs FSDP2 (set fsdp_version: 2)")
    if _env_flag("FSDP_OFFLOAD_PARAMS") and not torch.cuda.is_available():
        raise KHAError("fsdp_offload_params: true offloads to the CPU, where this run already is: set it to false")
    if not _env_flag("FSDP_RESHARD_AFTER_FORWARD", "true"):
        raise KHAError(
            "fsdp_reshard_after_forward: false is not honoured: transformers' FSDP2 plan frees each decoder "
            "layer's full weight after its forward (set it to true)"
        )
    if _env_flag("FSDP_ACTIVATION_CHECKPOINTING"):
        raise KHAError("fsdp_activation_checkpointing: use kha train --gradient-checkpointing instead")
    # accelerate's default for FSDP2 when the config names none
    state_dict_type = os.environ.get("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT").strip().upper()
    if state_dict_type not in STATE_DICT_TYPES:
        raise KHAError(f"fsdp_state_dict_type {state_dict_type}: kha train writes one of {', '.join(STATE_DICT_TYPES)}")
    return state_dict_type


def check_plan_fits(plan: ParallelPlan | None, config) -> None:
    """One-line KHAError, before the model loads, for expert parallelism on a model whose experts it cannot split:
    a dense model, or a number of experts EP_SIZE does not divide. CONFIG: a config object or a checkpoint's dict."""
    if plan is None or plan.ep_size == 1:
        return
    if not isinstance(config, dict):
        config = config.get_text_config().to_dict()
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    experts = next((text[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if text.get(k)), None)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 2:
        raise KHAError(f"--ep-size {plan.ep_size} splits the experts of a mixture-of-experts model: this one has none")
    if experts % plan.ep_size:
        raise KHAError(f"--ep-size {plan.ep_size} does not divide the model's {experts} experts")


def hand_over_from_accelerate(plan: ParallelPlan | None) -> None:
    """Turn accelerate's own FSDP plugin off for a run whose PLAN transformers shards (before TrainingArguments set
    up accelerate's state): on GPUs accelerate would otherwise wrap the model a second time, on CPUs it runs DDP."""
    if plan is not None:
        os.environ["ACCELERATE_USE_FSDP"] = "false"


def load_sharded(model_class, model_path, plan: ParallelPlan, **kwargs):
    """MODEL_CLASS.from_pretrained(MODEL_PATH) laid out by PLAN: built on the meta device, each rank materialising
    and reading its own shard only."""
    model = model_class.from_pretrained(model_path, distributed_config=plan.distributed_config(), **kwargs)
    # transformers 5.25 reads a sharded checkpoint (distributed_checkpoint=True) into a tied output head as a
    # parameter of its own (with the same values): tie it to the input embedding again, or it would train apart
    if getattr(model, "all_tied_weights_keys", None):
        model.tie_weights()
    return model


def build_sharded(build, model_class, plan: ParallelPlan, work: Path, **kwargs):
    """New weights laid out by PLAN: the main process builds the model (BUILD(), seeded: what 1 process builds) and
    saves it to a `.kha-init-*` folder inside WORK (the run's own working folder, shared by its ranks), and every
    rank loads its shard from there as from any checkpoint (`load_sharded`), so a run from a config shards through
    the same calls as a run from a checkpoint. Collective; the process group is the one TrainingArguments set up.
    The folder is removed once every rank has loaded, and any left in WORK by a killed build before it."""
    import shutil
    import tempfile

    import torch.distributed as dist

    main = dist.get_rank() == 0
    box: list = [None]
    if main:
        for stale in work.glob(".kha-init-*"):  # a build killed in this working folder before (kha's own)
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        folder = Path(tempfile.mkdtemp(prefix=".kha-init-", dir=work))
        try:
            build().save_pretrained(folder)
            box = [str(folder)]
        except BaseException as err:
            shutil.rmtree(folder, ignore_errors=True)
            dist.broadcast_object_list([""], src=0)  # the other ranks stop too, instead of waiting
            if isinstance(err, OSError):
                raise KHAError(f"cannot build the model in {work}: {err}") from err
            raise
    dist.broadcast_object_list(box, src=0)
    if not box[0]:
        raise KHAError("the main process could not build the model (its error is above)")
    try:
        return load_sharded(model_class, box[0], plan, **kwargs)
    finally:
        dist.barrier()
        if main:
            shutil.rmtree(box[0], ignore_errors=True)


def is_sharded(model) -> bool:
    return bool(getattr(model, "is_distributed_loading_by_transformers", False))


def is_main_process() -> bool:
    """Whether this is the run's first process (RANK 0 of an `accelerate launch` / torchrun run, or the only one):
    the one that prints, read before any process group is set up."""
    return os.environ.get("RANK", "0").strip() in ("0", "")
