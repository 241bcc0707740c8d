"""Per-step stability records (training/stability.py): the spike definition on planted spikes, a spike planted in a
real run and found, the largest attention logit against a hand-written reference, the gradient norms and learning
rate against Trainer's own logs, and `kha train`'s stability.jsonl and train_results.json."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from kha_hf import KHAForCausalLM
from kha_hf.training.spikes import check_spike_margin, count_spikes, spike_steps
from kha_hf.training.train import paper_training_arguments
from kha_hf.training.trainer import KHATrainer
from tests.helpers import save_tiny_tokenizer
from tests.training.conftest import tiny_qwen3 as tiny_qwen3_config

VOCAB = 64


def tiny_qwen3(attn="sdpa"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config(VOCAB), attn_implementation=attn)


def blocks(n: int, length: int = 16, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (length,), generator=gen)
        out.append({"input_ids": ids, "labels": ids})
    return out


def trainer_for(model, tmp_path, steps, data, **kwargs):
    args = paper_training_arguments(
        tmp_path / "run",
        max_steps=steps,
        per_device_train_batch_size=kwargs.pop("batch", 2),
        learning_rate=kwargs.pop("lr", 1e-3),
        logging_steps=kwargs.pop("logging_steps", 1),
        save_strategy="no",
        disable_tqdm=True,
        **kwargs.pop("args", {}),
    )
    return KHATrainer(model=model, args=args, train_dataset=data, **kwargs)


def test_the_spike_definition_on_planted_losses():
    flat = [3.0 + 0.01 * (i % 3) for i in range(60)]
    assert spike_steps(flat) == []
    falling = [8.0 - 0.05 * i for i in range(100)]  # early training: always below its past median
    assert spike_steps(falling) == []
    planted = list(flat)
    planted[40] = 3.5  # 16 % above the median of 3.01
    planted[50], planted[51] = 4.0, 4.1  # one spike of two steps
    assert spike_steps(planted) == [40, 50, 51]
    assert count_spikes(planted) == 2
    assert count_spikes(planted, margin=0.2) == 1  # 3.5 is under (1 + 0.2) x 3.01
    planted[5] = 9.0  # before 10 steps of history: not judged
    assert spike_steps(planted)[0] == 40
    planted[55] = math.nan  # a diverged step is a spike
    assert 55 in spike_steps(planted)
    for bad in (0, -0.1, math.nan, math.inf, True, "0.1"):
        with pytest.raises(ValueError, match="spike margin must be a positive number"):
            check_spike_margin(bad)


class PerturbAt(TrainerCallback):
    """Plants a spike: at the end of step STEP - 1 every weight gets noise, so step STEP's loss jumps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step - 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.5)
        return control


def test_a_spike_planted_in_a_real_run_is_found_at_its_step(tmp_path):
    data = [{"input_ids": torch.arange(16) % 8, "labels": torch.arange(16) % 8} for _ in range(128)]  # learnable
    model = KHAForCausalLM.from_base(tiny_qwen3(), knock="mlp_v")
    trainer = trainer_for(model, tmp_path, 40, data, lr=3e-3, stability_every=10, callbacks=[PerturbAt(30)])
    trainer.train()
    rows = trainer.stability.rows
    assert [r["step"] for r in rows] == list(range(1, 41))
    losses = [r["loss"] for r in rows]
    assert rows[spike_steps(losses)[0]]["step"] == 30, losses
    assert count_spikes(losses) == 1
    assert count_spikes(losses[:29]) == 0  # without the plant, no spike


def test_norms_and_learning_rate_match_trainers_logs_and_the_knocks_norm_is_their_own(tmp_path):
    model = KHAForCausalLM.from_base(tiny_qwen3(), knock="mlp_qkv")
    trainer = trainer_for(model, tmp_path, 6, blocks(24), stability_every=3)
    trainer.train()
    logged = {h["step"]: h for h in trainer.state.log_history if "grad_norm" in h}
    for row in trainer.stability.rows:
        assert row["grad_norm"] == pytest.approx(logged[row["step"]]["grad_norm"], rel=1e-5)  # pre-clip, as logged
        assert row["lr"] == pytest.approx(logged[row["step"]]["learning_rate"])
        assert 0 < row["knock_grad_norm"] < row["grad_norm"]
        assert ("max_logit" in row) == (row["step"] in (1, 3, 6))
    # only the knocks train: the global norm is the knocks' norm
    frozen = KHAForCausalLM.from_base(tiny_qwen3(), knock="mlp_v")
    for name, p in frozen.named_parameters():
        p.requires_grad_("_knock." in name)
    trainer = trainer_for(frozen, tmp_path, 3, blocks(12), stability_every=0)
    trainer.train()
    for row in trainer.stability.rows:
        assert row["knock_grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-5)
        assert "max_logit" not in row  # logit_every 0: never probed


def _reference_largest_logits(model, ids) -> list[float]:
    """Each layer's max q·k·scaling over causal pairs, from the projections, q/k norms and RoPE written out here."""
    captured = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: captured.__setitem__(
                i, (kwargs["hidden_states"], kwargs["position_embeddings"])
            ),
            with_kwargs=True,
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    out = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        hidden, (cos, sin) = captured[i]
        b, t, _ = hidden.shape
        q = attn.q_proj(hidden).view(b, t, -1, attn.head_dim)
        k = attn.k_proj(hidden).view(b, t, -1, attn.head_dim)
        if attn.q_knock is not None:
            q = attn.q_knock(q)
        if attn.k_knock is not None:
            k = attn.k_knock(k)
        q, k = attn.q_norm(q).transpose(1, 2), attn.k_norm(k).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = (q @ k.transpose(-1, -2)) * attn.scaling
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
        out.append(scores.max().item())
    return out


def test_the_largest_attention_logit_equals_a_hand_written_reference(tmp_path):
    model = KHAForCausalLM.from_base(tiny_qwen3(), knock="mlp_qkv")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_knock." in name:
                p.add_(0.3 * torch.randn_like(p))
            if "q_norm" in name:
                p.mul_(4.0)  # large logits, far from the defaults
    before = copy.deepcopy(model)
    data = blocks(1)
    trainer = trainer_for(model, tmp_path, 1, data, batch=1, stability_every=1)
    trainer.train()
    got = trainer.stability.rows[0]["max_logit"]
    expected = _reference_largest_logits(before.train(), data[0]["input_ids"][None])
    assert got == pytest.approx(expected, rel=1e-5)
    assert max(got) > 5
    assert model.config._attn_implementation == "sdpa"  # the probe is gone after training


def test_an_eager_model_records_everything_but_the_logits(tmp_path):
    model = KHAForCausalLM.from_base(tiny_qwen3("eager"), knock="mlp_v")
    trainer = trainer_for(model, tmp_path, 2, blocks(8), stability_every=1)
    trainer.train()
    assert all("max_logit" not in r and r["grad_norm"] > 0 for r in trainer.stability.rows)
    assert model.config._attn_implementation == "eager"


def test_kha_train_writes_stability_lines_and_counts_spikes(tmp_path):
    from kha_hf.cli import main
    from kha_hf.training.data import read_documents

    (tmp_path / "data.md").write_text(read_documents(None)[0][:20000])
    config = tiny_qwen3().config
    config.vocab_size = 300
    config.save_pretrained(tmp_path / "cfg")
    save_tiny_tokenizer(tmp_path / "tok")
    argv = ["train", str(tmp_path / "cfg"), "--mode", "full", "--output", str(tmp_path / "out"), "--data"]
    argv += [
        str(tmp_path / "data.md"),
        "--max-steps",
        "6",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--logit-every",
        "2",
        "--tokenizer",
        str(tmp_path / "tok"),
    ]
    assert main(argv) == 0
    lines = [json.loads(line) for line in (tmp_path / "out" / "stability.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == list(range(1, 7))
    assert [("max_logit" in row) for row in lines] == [True, True, False, True, False, True]
    results = json.loads((tmp_path / "out" / "train_results.json").read_text())
    assert results["loss_spikes"] == count_spikes([row["loss"] for row in lines])
    assert results["max_grad_norm"] == max(row["grad_norm"] for row in lines)


def test_a_run_that_fails_gives_the_model_its_sdpa_back_and_the_next_run_probes(tmp_path):
    from kha_hf.training import stability

    model = KHAForCausalLM.from_base(tiny_qwen3(), knock="mlp_v")
    calls = []

    def fail_on_second_forward(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory, say")

    handle = model.model.register_forward_pre_hook(fail_on_second_forward)
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer_for(model, tmp_path, 4, blocks(8), stability_every=1).train()
    handle.remove()
    assert model.config._attn_implementation == "sdpa" and stability._ACTIVE == []
    trainer = trainer_for(model, tmp_path, 2, blocks(8), stability_every=1)
    trainer.train()
    assert all("max_logit" in row for row in trainer.stability.rows)


def test_stability_lines_survive_garbage_and_a_cut_line(tmp_path):
    from kha_hf.training.stability import StabilityLog, read_stability_lines

    path = tmp_path / "stability.jsonl"
    good = [{"step": s, "loss": 2.0, "grad_norm": 1.0, "knock_grad_norm": None, "lr": 1e-3} for s in (1, 2)]
    lines = [json.dumps(r) for r in good] + ['{"step": 7}', '{"step": 8, "loss": "x"}', '{"step": 9, "loss": 1,']
    path.write_bytes(("\n".join(lines)).encode() + b"\n\xff\xfe not utf-8\n" + b'{"step": 3, "loss": 2.5, "gr')
    log = StabilityLog(logit_every=0)
    log.append_to(path)  # the cut last line is ended: the next row is a line of its own
    log.add_loss(2.25)
    log.end_step(3, 1e-3)
    rows = read_stability_lines(path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["loss"] == 2.25


def test_a_resumed_run_keeps_its_steps_up_to_the_checkpoint_and_the_counts_stream(tmp_path):
    import tracemalloc

    from kha_hf.training.stability import StabilityLog, iter_stability_lines, stability_metrics

    path = tmp_path / "stability.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 3.0}) + "\n" for s in range(1, 11)))
    log = StabilityLog(logit_every=0)
    log.append_to(path, keep_until=5)  # resumed from checkpoint-5: steps 6 to 10 run again
    log.add_loss(2.0)
    log.end_step(6, None)
    assert [(r["step"], r["loss"]) for r in iter_stability_lines(path)][-2:] == [(5, 3.0), (6, 2.0)]
    assert log.rows == []  # written to the file, not kept in memory
    # the counts stream: their memory does not grow with the run's length
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for s in range(1, 200_001):
            f.write(json.dumps({"step": s, "loss": 5.0 if s == 150_000 else 3.0, "grad_norm": float(s)}) + "\n")
    tracemalloc.start()
    metrics = stability_metrics(iter_stability_lines(big), 0.1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert metrics["loss_spikes"] == 1 and metrics["max_grad_norm"] == 200_000.0
    assert peak < 1 << 20, f"{peak} bytes for 200,000 rows"
