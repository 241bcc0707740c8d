"""KHATrainer: transformers' Trainer with knocks kept out of weight decay, an optional knock learning rate, and
knock / throughput metrics in every training log."""

from __future__ import annotations

import time
from pathlib import Path

from transformers import Trainer, TrainerCallback

from ..common.model_code import copy_model_code
from ..data.corpus import TokenBlockFile
from ..data.order import GlobalBlockOrder
from .engine_checks import RankChecks
from .parallel import is_sharded
from .params import is_knock_parameter, knock_distance_from_init, optimizer_param_groups
from .progress import use_readable_progress
from .run_state import load_run_state, save_run_state, save_sharded_model
from .stability import StabilityLog, gradient_norm, stability_callback, stop_probing
from .throughput import flops_per_token, throughput_logs


class KHATrainer(Trainer):
    """transformers' `Trainer` that never decays the knocks, with an optional knock learning rate.

    Weight decay pulls a weight toward 0, but a knock's neutral value is the identity: a plain `Trainer` with
    `weight_decay > 0` would pull a converted model away from its base. Every other argument, default and behaviour
    is `Trainer`'s. On top of it: an evaluation batch never larger than the evaluation set (so a small held-out set
    still gives an `eval_loss` with `dataloader_drop_last`), `knock_distance` (mean ‖W − W0‖ of the knocks) and
    `tokens_per_second` in every training log, and, in a run of several processes, a check at the end that every
    rank holds the same knocks.

    Args:
        *args: `Trainer`'s positional arguments (`model`, `args`, ...).
        knock_lr: the knocks' learning rate (default: `args.learning_rate`, as for every other parameter).
        **kwargs: `Trainer`'s keyword arguments.

    Example:
        `KHATrainer(model, TrainingArguments("out", weight_decay=0.1), train_dataset=data, knock_lr=1e-3).train()`
    """

    def __init__(
        self,
        *args,
        knock_lr: float | None = None,
        stability_every: int | None = None,
        plan=None,
        seq_len: int | None = None,
        peak_flops: float | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        # a model sharded at load time (training/parallel.py): kha saves and restores what Trainer does not
        self.plan = plan if is_sharded(self.model) else None
        # per-step loss, gradient norms and learning rate, the attention logits every K steps (training/stability.py)
        self.stability = None if stability_every is None else StabilityLog(stability_every)
        if self.stability is not None:
            self.add_callback(stability_callback(self))
        self.fit_eval_batch()
        use_readable_progress(self)  # a step bar and one line per log, not raw dicts
        self.add_callback(RankChecks(self))  # knocks at their start, out of weight decay and alike at the end
        self.knock_lr = knock_lr
        self.resumed_from_step = 0  # the checkpoint's step when train() resumes one (set by kha train)
        self._last_log = (time.perf_counter(), 0)
        self._knocks_train = any(p.requires_grad and is_knock_parameter(n) for n, p in self.model.named_parameters())
        # model FLOPs a token (training/throughput.py): every training log records the FLOP/s, and MFU with a peak
        self._flops_token = flops_per_token(self.model, seq_len) if seq_len else None
        self.peak_flops = peak_flops

    def fit_eval_batch(self, *also) -> None:
        """Shrink the evaluation batch to the smallest evaluation set (the trainer's, each of a dict of them, and
        ALSO: sets evaluated later by `evaluate(eval_dataset=...)`)."""
        # The paper's arguments drop incomplete batches (`dataloader_drop_last`, so DDP ranks see equal batches),
        # and Trainer applies that to evaluation too: a held-out set smaller than one batch would give no batch and
        # no eval_loss at all (transformers 5.24). Shrink the eval batch to what the set holds.
        sets = list(self.eval_dataset.values()) if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        for eval_set in [*sets, *also]:
            if eval_set is None or not hasattr(eval_set, "__len__"):
                continue
            per_device = max(1, len(eval_set) // max(1, self.args.world_size))
            if self.args.per_device_eval_batch_size > per_device:
                self.args.per_device_eval_batch_size = per_device

    def _get_train_sampler(self, *args, **kwargs):
        # A prepared corpus's blocks go in one global order computed from the seed (data.order): constant memory
        # where RandomSampler holds a permutation of every block, and the same blocks at each step for any number
        # of processes. Anything else keeps Trainer's sampler.
        dataset = next(iter(args), kwargs.get("train_dataset"))  # (train_dataset=None) since transformers 4.x
        dataset = self.train_dataset if dataset is None else dataset
        if isinstance(dataset, TokenBlockFile):
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return GlobalBlockOrder(len(dataset), seed)
        return super()._get_train_sampler(*args, **kwargs)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # an exception skips on_train_end: the model gets its SDPA back here, not in a later run
            if self.stability is not None:
                self.stability.probing = False
                stop_probing(self.model, self.stability)

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        if self.stability is not None:  # what Trainer adds to its logged loss, per micro-batch
            self.stability.add_loss(float(loss))
        return loss

    def _clip_grad_norm(self, model):
        # Trainer's one call per optimizer step that sees the whole gradient before clipping (transformers 5.16.1 to
        # 5.25, where it returns the pre-clip norm): the knocks' norm is read first, the global norm is its result.
        if self.stability is None:
            return super()._clip_grad_norm(model)
        knocks = gradient_norm([p for n, p in model.named_parameters() if is_knock_parameter(n)])
        norm = super()._clip_grad_norm(model)
        self.stability.set_norms(None if norm is None else float(norm), knocks)
        return norm

    # -- a model sharded at load time (training/parallel.py): its checkpoints and their resume --------------------
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        if self.plan is None or not self.plan.sharded_checkpoints:
            return super()._save(output_dir, state_dict)
        # SHARDED_STATE_DICT: each rank writes its shard (torch DCP, safetensors); from_pretrained with the same
        # layout reads them back (a resume), and the final save is whole (train.py)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        save_sharded_model(self.model, Path(output_dir), self.args.should_save)
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.plan is None:
            return
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        self._save_rng_state(str(folder))  # Trainer's own per-rank files, which save_only_model leaves out
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds torch's
        save_run_state(self.model, optimizer, self.lr_scheduler, folder, self.plan.layout(), self.args.should_save)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self.plan is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # kha train loaded the checkpoint's weights into the sharded model already (parallel.load_sharded)

    def _issue_warnings_after_load(self, load_result) -> None:
        # A tied output head is saved once, as the embedding (safetensors keeps one of tensors that share memory),
        # and Trainer forgives only `_keys_to_ignore_on_save`, empty for tied heads in transformers 5.16.1-5.25: every
        # resume of a tied model warned "missing keys ['lm_head.weight']" for a weight that is loaded, as the
        # embedding it is. Only names of a parameter that another name also holds are forgiven here.
        names: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        tied = {name for group in names.values() if len(group) > 1 for name in group}
        missing = [key for key in load_result.missing_keys if key not in tied]
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if self.plan is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        load_run_state(self.model, optimizer, self.lr_scheduler, Path(checkpoint), self.plan.layout())

    def get_decay_parameter_names(self, model) -> list[str]:
        # Decay pulls toward 0, but a knock's neutral value is the identity: never decay knocks.
        return [name for name in super().get_decay_parameter_names(model) if not is_knock_parameter(name)]

    def create_optimizer(self, model=None):
        if self.knock_lr is None or self.optimizer is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        groups = optimizer_param_groups(
            opt_model,
            weight_decay=self.args.weight_decay,
            knock_lr=self.knock_lr,
            decay_names=set(self.get_decay_parameter_names(opt_model)),  # Trainer's own decay rule elsewhere
        )
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: add what KHA users watch
            if self._knocks_train:  # a run that trains no knocks (a LoRA control) has nothing to report
                logs["knock_distance"] = round(knock_distance_from_init(self.model), 6)
            now, tokens = time.perf_counter(), int(self.state.num_input_tokens_seen or 0)
            last_time, last_tokens = self._last_log
            if tokens > last_tokens and now > last_time:
                rate = (tokens - last_tokens) / (now - last_time)  # every process's tokens (Trainer gathers them)
                logs["tokens_per_second"] = round(rate, 1)
                if self._flops_token:
                    logs.update(throughput_logs(rate, self._flops_token, self.peak_flops, self.args.world_size))
            self._last_log = (now, tokens)
        if "train_runtime" in logs and self.stability is not None:  # the end of train(): the whole run's summary
            # Trainer's train_loss covers the steps this process ran (transformers 5.25; 5.16 divides their sum by
            # every step), so a resumed run reported another mean than the same run uninterrupted: the record's is
            # the run's (its step losses are the ones Trainer logs, the mean over ranks)
            whole = self.stability.mean_loss()
            if whole is not None:
                logs["train_loss"] = whole
            logs["resumed_from_step"] = self.resumed_from_step
        super().log(logs, start_time)


class CheckpointCodeCallback(TrainerCallback):
    """Make every intermediate checkpoint of a full KHA model loadable with trust_remote_code: copy the code
    files and a config with auto_map if the save did not (models built without kha_hf's auto registration)."""

    def on_save(self, args, state, control, model=None, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir() and (folder / "config.json").exists() and not (folder / "modeling_kha.py").exists():
            copy_model_code(folder)
        return control
