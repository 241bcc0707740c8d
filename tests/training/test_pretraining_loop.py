"""The pretraining loop (#69): new weights train at their preset's learning rate, the schedules are transformers' own
and do what their names say, the validation split is evaluated while training (never the held-out one) and kept in
trainer_state.json and validation.jsonl, every log records FLOP/s and MFU from the model's shape, and the run says
what it built."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer

from kha_hf import KHAForCausalLM
from kha_hf.common.errors import KHAError
from kha_hf.data.corpus import open_corpus
from kha_hf.training.schedules import Schedule
from kha_hf.training.throughput import flops_per_token, throughput_logs
from kha_hf.training.train import paper_training_arguments, train
from tests.cli.test_bad_input import one_line_error

STEPS, SEQ, BATCH, EVAL_BLOCKS = 4, 32, 2, 4
try:  # the `track` extra (setup.cfg), in the test extras: --report-to tensorboard, offline
    import tensorboard  # noqa: F401

    TENSORBOARD = True
except ImportError:
    TENSORBOARD = False


def learning_rates(schedule: Schedule, steps: int, tmp_path, peak: float = 1.0) -> list[float]:
    """The learning rate of each of STEPS optimizer steps under SCHEDULE, from the scheduler Trainer itself builds,
    and last the rate where the schedule ends (after the last step)."""
    model = torch.nn.Linear(2, 2)
    args = paper_training_arguments(tmp_path, max_steps=steps, learning_rate=peak, **schedule.training_arguments(steps))
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    return [*rates, trainer.optimizer.param_groups[0]["lr"]]


def test_the_schedules_are_what_their_names_say(tmp_path):
    cosine = learning_rates(Schedule("cosine", warmup_steps=10), 100, tmp_path)
    assert cosine[:3] == pytest.approx([0.0, 0.1, 0.2]) and cosine[10] == pytest.approx(1.0)
    assert cosine[-1] == pytest.approx(0.1) and min(cosine[10:]) >= 0.1 - 1e-9  # the paper's floor: 10 % of the peak
    wsd = learning_rates(Schedule("wsd", warmup_ratio=0.1, decay_ratio=0.2, min_lr_ratio=0.05), 100, tmp_path)
    assert all(rate == pytest.approx(1.0) for rate in wsd[10:80])  # stable at the peak until the last 20 %
    assert wsd[81] < 1.0 and wsd[-1] == pytest.approx(0.05)
    linear = learning_rates(Schedule("linear", warmup_steps=0, min_lr_ratio=0.2), 100, tmp_path)
    steps = [a - b for a, b in zip(linear, linear[1:], strict=False)]
    assert linear[0] == pytest.approx(1.0) and max(steps) == pytest.approx(min(steps), abs=1e-9)  # a straight line
    assert linear[-1] == pytest.approx(0.2)
    constant = learning_rates(Schedule("constant", warmup_steps=5), 20, tmp_path)
    assert constant[5:] == [pytest.approx(1.0)] * 16 and constant[0] == 0.0


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (Schedule("cosine", decay_ratio=0.3), "--decay-ratio applies to --lr-scheduler wsd only"),
        (Schedule("constant", min_lr_ratio=0.1), "--min-lr-ratio does not apply to --lr-scheduler constant"),
        (Schedule("wsd", warmup_steps=5, warmup_ratio=0.1), "--warmup-steps and --warmup-ratio both set the warmup"),
        (Schedule("linear", warmup_steps=50), "a warmup of 50 steps is longer than the run's 10 steps"),
        (Schedule("step"), "unknown --lr-scheduler 'step'"),
    ],
)
def test_a_schedule_that_does_not_apply_is_refused(schedule, message):
    with pytest.raises(KHAError, match=message):
        schedule.training_arguments(10)


def test_the_cli_refuses_both_warmups_in_one_line(capsys):
    argv = ["train", "cpu-smoke", "--output", "x", "--warmup-steps", "3", "--warmup-ratio", "0.1"]
    assert "--warmup-ratio: not allowed with argument --warmup-steps" in one_line_error(capsys, argv, "train")


def test_model_flops_count_every_weight_a_token_passes_once_and_each_knock_per_head():
    config = Qwen3Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    base = Qwen3ForCausalLM(config)
    total = sum(p.numel() for p in base.parameters())  # the tied head counted once: as the embedding
    # the embedding is a lookup, the tied head a multiply: 6 x every parameter, plus the attention's 12 L H d T
    assert flops_per_token(base, 16) == 6 * total + 12 * 2 * 4 * 8 * 16
    kha = KHAForCausalLM.from_base(Qwen3ForCausalLM(config), knock="linear_v")
    knocks = sum(p.numel() for n, p in kha.named_parameters() if "v_knock" in n)
    assert knocks == 2 * 8 * 8
    assert flops_per_token(kha, 16) == flops_per_token(base, 16) + 6 * knocks * 2  # applied to each of 2 KV heads
    logs = throughput_logs(1000.0, 2e6, 1e10, devices=2)
    assert logs == {"model_flops_per_second": 2e9, "mfu": 0.1}


def test_deepspeeds_cpu_notice_is_dropped_and_nothing_else():
    from kha_hf.training.deepspeed_config import quiet_deepspeed_cpu_notice

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        quiet_deepspeed_cpu_notice()
        quiet_deepspeed_cpu_notice()  # once, however often a run starts
        logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        logger.warning("another warning")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["another warning"]


@pytest.fixture(scope="module")
def pretrained(prepared, tmp_path_factory):
    """cpu-smoke from scratch on the prepared corpus with no --lr: constant after no warmup, the validation split
    every 2 steps, and a peak for the MFU."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("pretrain") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = train(
            "cpu-smoke", out, data=[str(prepared)], mode="full", max_steps=STEPS, seq_len=SEQ, batch_size=BATCH,
            max_eval_blocks=EVAL_BLOCKS, disable_tqdm=True, logging_steps=1, lr_scheduler="constant", warmup_steps=0,
            eval_steps=2, peak_flops=1e12, report_to="tensorboard" if TENSORBOARD else "none",
        )  # fmt: skip
    return out, result, printed.getvalue()


def test_new_weights_train_at_their_presets_rate_and_say_so(pretrained):
    out, result, printed = pretrained
    rates = [h["learning_rate"] for h in result.log_history if "loss" in h]
    assert rates == [pytest.approx(3e-3)] * STEPS  # cpu-smoke's, not --mode full's 5e-5 for checkpoints
    assert "learning rate 0.003 (the cpu-smoke preset's default; --lr sets another)" in printed
    assert "schedule constant after 0 warmup steps" in printed
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    assert f"vocabulary {vocab:,} from the tokenizer " in printed and "cpu-smoke states 1,024" in printed


def test_the_validation_split_is_evaluated_while_training_and_recorded(pretrained, prepared):
    out, result, _ = pretrained
    state = json.loads((out / "trainer_state.json").read_text())
    while_training = {h["step"]: h["eval_validation_loss"] for h in state["log_history"] if "eval_validation_loss" in h}
    assert sorted(while_training) == [2, 4]
    record = [json.loads(line) for line in (out / "validation.jsonl").read_text().splitlines()]
    assert [(r["step"], r["validation_loss"]) for r in record] == sorted(while_training.items())
    assert record[-1]["tokens_seen"] == STEPS * BATCH * SEQ
    # the loss of the saved model (step 4) on the prepared validation split's first blocks, computed here
    model = KHAForCausalLM.from_pretrained(out).eval()
    blocks = open_corpus(prepared).blocks("validation", SEQ, EVAL_BLOCKS)
    with torch.no_grad():
        batch = torch.stack([blocks.read(i) for i in range(len(blocks))])
        losses = [model(input_ids=batch[i : i + BATCH], labels=batch[i : i + BATCH]).loss for i in (0, BATCH)]
    assert float(torch.stack(losses).mean()) == pytest.approx(while_training[4], abs=1e-5)
    heldout = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert heldout == pytest.approx(result.heldout_loss) and abs(heldout - while_training[4]) > 1e-4  # another split


def test_every_log_records_throughput_and_mfu(pretrained):
    _, result, printed = pretrained
    model = KHAForCausalLM.from_pretrained(pretrained[0])
    per_token = flops_per_token(model, SEQ)
    logs = [h for h in result.log_history if "loss" in h and "tokens_per_second" in h]
    assert logs
    for log in logs:
        # tokens/s is logged to 0.1: at the few tokens/s of a 4-step run that rounding alone is a few per mille
        assert log["model_flops_per_second"] == pytest.approx(
            log["tokens_per_second"] * per_token, abs=0.05 * per_token + 1e-3 * log["model_flops_per_second"]
        )
        assert log["mfu"] == pytest.approx(log["model_flops_per_second"] / 1e12, abs=1e-5)
    assert " FLOP/s  MFU " in printed


@pytest.mark.skipif(not TENSORBOARD, reason="the track extra (tensorboard) is not installed")
def test_report_to_tensorboard_writes_the_logged_losses_offline(pretrained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, result, _ = pretrained
    events = list(out.rglob("events.out.tfevents.*"))
    assert events and len({e.parent for e in events}) == 1, events  # one run's folder (a writer per train/evaluate)
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    written = {event.step: event.value for event in accumulator.Scalars("train/loss")}
    logged = {h["step"]: h["loss"] for h in result.log_history if "loss" in h}
    assert written == pytest.approx(logged, abs=1e-6) and sorted(written) == list(range(1, STEPS + 1))
    validation = {event.step: event.value for event in accumulator.Scalars("eval/validation_loss")}
    assert sorted(validation) == [2, 4]
