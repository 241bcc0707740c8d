"""Training output people can read: a step bar (step/total, rate, ETA) and one line per log instead of raw dicts."""

from __future__ import annotations

from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback

_SHOWN = {
    "learning_rate": "lr {:.2e}",
    "tokens_per_second": "{:,.0f} tok/s",
    "model_flops_per_second": "{:.3g} FLOP/s",
    "mfu": "MFU {:.1%}",
    "knock_distance": "knock distance {:.4f}",
}


def format_log(logs: dict, step: int, max_steps: int) -> str:
    """One line: step, loss, learning rate, tokens/s, FLOP/s (MFU) and knock distance for training logs; the
    validation or held-out loss for evaluations."""
    if "loss" in logs:
        parts = [f"step {step}/{max_steps}", f"loss {logs['loss']:.4f}"]
        parts += [shown.format(float(logs[key])) for key, shown in _SHOWN.items() if key in logs]
        return "  ".join(parts)
    if "eval_validation_loss" in logs:  # --eval-steps: the validation split, while training
        return f"step {step}/{max_steps}  validation loss {logs['eval_validation_loss']:.4f}"
    if "eval_loss" in logs:
        when = "before training" if max_steps == 0 else f"step {step}/{max_steps}"
        return f"{when}  held-out loss {logs['eval_loss']:.4f}"
    if "train_runtime" in logs:
        mean_loss = logs.get("train_loss", float("nan"))
        start = int(logs.get("resumed_from_step") or 0)
        if start:  # a resumed run: the steps this process ran, and the mean of the whole run's
            return (
                f"trained steps {start + 1}-{step} (resumed at step {start}) in {logs['train_runtime']:.0f} s, "
                f"mean loss of the run's {step} steps {mean_loss:.4f}"
            )
        return f"trained {step} steps in {logs['train_runtime']:.0f} s, mean loss {mean_loss:.4f}"
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in logs.items())


class ReadableProgress(ProgressCallback):
    """transformers' progress bars, labelled ("training", "evaluating"), with readable log lines; without bars
    (`disable_tqdm`) the lines alone."""

    def on_train_begin(self, args, state, control, **kwargs):
        if not args.disable_tqdm and state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, desc="training", unit="step", dynamic_ncols=True)
        self.current_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kwargs)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if args.disable_tqdm or not state.is_world_process_zero:
            return
        if self.prediction_bar is None and eval_dataloader is not None and hasattr(eval_dataloader, "__len__"):
            self.prediction_bar = tqdm(
                total=len(eval_dataloader),
                desc="evaluating",
                unit="batch",
                leave=self.training_bar is None,
                dynamic_ncols=True,
            )
        if self.prediction_bar is not None:
            self.prediction_bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        line = format_log(logs, state.global_step, state.max_steps)
        (self.training_bar.write if self.training_bar is not None else print)(line)

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)


def use_readable_progress(trainer) -> None:
    """Replace the Trainer's default progress/printer callback with `ReadableProgress`."""
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(ReadableProgress)
