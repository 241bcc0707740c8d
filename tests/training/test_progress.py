"""Training prints a step bar and one readable line per log (never raw dicts), whatever the Trainer settings."""

from transformers import PrinterCallback, ProgressCallback

from kha_hf.training.progress import ReadableProgress, format_log


def test_log_lines_are_readable():
    line = format_log(
        {"loss": 3.51234, "learning_rate": 1.2e-3, "tokens_per_second": 4120.4, "knock_distance": 0.0123}, 12, 60
    )
    assert line == "step 12/60  loss 3.5123  lr 1.20e-03  4,120 tok/s  knock distance 0.0123"
    assert format_log({"eval_loss": 3.377, "epoch": 0.1}, 60, 60) == "step 60/60  held-out loss 3.3770"
    assert "{" not in format_log({"train_runtime": 24.2, "train_loss": 3.8}, 60, 60)
    # a resumed run (#70 item 14): the steps this process ran, and the whole run's mean
    resumed = format_log({"train_runtime": 8.4, "train_loss": 3.8, "resumed_from_step": 4}, 6, 6)
    assert resumed == "trained steps 5-6 (resumed at step 4) in 8 s, mean loss of the run's 6 steps 3.8000"


def test_kha_trainer_installs_the_readable_progress_for_bars_and_no_bars(tmp_path):
    from kha_hf import KHAForCausalLM
    from kha_hf.training.train import paper_training_arguments
    from kha_hf.training.trainer import KHATrainer
    from tests.helpers import tiny_base_model

    model = KHAForCausalLM.from_base(tiny_base_model("llama"))
    for disable_tqdm in (False, True):
        args = paper_training_arguments(tmp_path, max_steps=1, disable_tqdm=disable_tqdm)
        callbacks = [type(c) for c in KHATrainer(model=model, args=args).callback_handler.callbacks]
        assert ReadableProgress in callbacks
        assert ProgressCallback not in callbacks and PrinterCallback not in callbacks
