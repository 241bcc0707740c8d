"""`kha train`: each mode on a tiny model; knocks-only changes only knocks; checkpoints load as remote code."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kha_hf import KHAForCausalLM
from kha_hf.training.data import read_documents
from kha_hf.training.train import train
from tests.helpers import run_python
from tests.training.conftest import STEPS, tiny_qwen3


def test_full_mode_lowers_the_loss(corpus, kha_dir, tmp_path):
    data, _ = corpus
    result = train(kha_dir, tmp_path / "full", data=[str(data)], mode="full", max_steps=10, lr=3e-3, **STEPS)
    losses = [h["loss"] for h in result.log_history if "loss" in h]
    assert losses[-1] < losses[0], losses
    assert (tmp_path / "full" / "modeling_kha.py").exists()
    card = (tmp_path / "full" / "README.md").read_text()  # the source's card, tagged, with a training note
    assert "- kha" in card and "## Training" in card and "kha train --mode full" in card


def test_knocks_mode_trains_only_knocks_and_lowers_heldout_loss(corpus, kha_dir, tmp_path):
    data, _ = corpus
    before = load_file(kha_dir / "model.safetensors")
    result = train(
        kha_dir, tmp_path / "knocks", data=[str(data)], mode="knocks", max_steps=20, lr=1e-2, eval_before=True, **STEPS
    )
    after = load_file(tmp_path / "knocks" / "model.safetensors")
    assert set(after) == set(before)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all("_knock." in k for k in moved), [k for k in moved if "_knock." not in k]
    assert any("q_knock" in k for k in moved) and any("v_knock" in k for k in moved)
    logs = [h for h in result.log_history if "loss" in h]
    assert logs[-1]["knock_distance"] > 0 and "tokens_per_second" in logs[-1] and "learning_rate" in logs[-1]
    assert result.heldout_loss < result.heldout_loss_before, (result.heldout_loss, result.heldout_loss_before)


def test_knocks_get_no_weight_decay_and_their_own_lr(corpus, kha_dir, tmp_path):
    from kha_hf.training.modes import prepare_for_mode
    from kha_hf.training.train import paper_training_arguments
    from kha_hf.training.trainer import KHATrainer

    model = prepare_for_mode(KHAForCausalLM.from_pretrained(kha_dir), "full")
    trainer = KHATrainer(model=model, args=paper_training_arguments(tmp_path, max_steps=1), knock_lr=7e-3)
    optimizer = trainer.create_optimizer()
    knock_params = {id(p) for n, p in model.named_parameters() if "_knock." in n}
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        if ids & knock_params:
            assert ids == knock_params and group["weight_decay"] == 0.0 and group["lr"] == 7e-3
    assert not any("_knock." in n for n in trainer.get_decay_parameter_names(model))


def test_lora_mode_saves_adapter_that_reloads_exactly_and_merges(corpus, kha_dir, tmp_path):
    from peft import PeftModel

    data, _ = corpus
    result = train(kha_dir, tmp_path / "lora", data=[str(data)], mode="lora", max_steps=6, lr=5e-3, **STEPS)
    assert (result.adapter_dir / "adapter_model.safetensors").exists()
    adapter = load_file(result.adapter_dir / "adapter_model.safetensors")
    assert any("v_knock" in k for k in adapter) and any("lora_A" in k for k in adapter)

    reloaded = PeftModel.from_pretrained(KHAForCausalLM.from_pretrained(kha_dir), result.adapter_dir).eval()
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        adapter_logits = reloaded(ids).logits
        again = PeftModel.from_pretrained(KHAForCausalLM.from_pretrained(kha_dir), result.adapter_dir).eval()
        assert torch.equal(again(ids).logits, adapter_logits), "adapter reload is not deterministic"
        merged = KHAForCausalLM.from_pretrained(tmp_path / "lora")(ids).logits
        base = KHAForCausalLM.from_pretrained(kha_dir)(ids).logits
    assert (merged - adapter_logits).abs().max() < 1e-4, "merged checkpoint differs from base + adapter"
    assert (adapter_logits - base).abs().max() > 1e-4, "LoRA training changed nothing"
    # lora mode trains the knocks in full beside the adapters: their distance is reported
    assert all("knock_distance" in h for h in result.log_history if "loss" in h)


def test_a_run_that_trains_no_knocks_logs_no_knock_distance(tmp_path):
    # the A/B's LoRA control (stock model + adapters) used to log "knock distance 0.0000" at every step
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    from kha_hf.training.train import paper_training_arguments
    from kha_hf.training.trainer import KHATrainer

    control = get_peft_model(Qwen3ForCausalLM(tiny_qwen3(512)), LoraConfig(r=4, target_modules=["v_proj"]))
    knocked = KHAForCausalLM.from_base(Qwen3ForCausalLM(tiny_qwen3(512)), knock="mlp_v")
    for model, expected in ((control, False), (knocked, True)):
        trainer = KHATrainer(model=model, args=paper_training_arguments(tmp_path, max_steps=1))
        trainer.log({"loss": 1.0})
        assert ("knock_distance" in trainer.state.log_history[-1]) is expected


def test_progress_bars_are_labelled(corpus, kha_dir, tmp_path, capsys):
    data, _ = corpus
    steps = dict(STEPS, disable_tqdm=False)
    train(kha_dir, tmp_path / "bars", data=[str(data)], mode="knocks", max_steps=2, eval_before=True, **steps)
    err = capsys.readouterr().err
    assert "training: " in err and "evaluating: " in err, err[-2000:]


@pytest.mark.parametrize("mode", ["knocks", "lora"])
def test_every_checkpoint_loads_as_remote_code_in_a_fresh_process(corpus, kha_dir, tmp_path, mode):
    # lora checkpoints are adapters: transformers loads their KHA base (remote code) and applies them
    data, _ = corpus
    out = tmp_path / "run"
    train(kha_dir, out, data=[str(data)], mode=mode, max_steps=4, save_steps=2, lr=1e-2, **STEPS)
    folders = sorted(out.glob("checkpoint-*")) + [out]
    assert len(folders) == 3
    ids = [[5, 17, 42, 99, 7, 63]]
    script = textwrap.dedent(
        f"""
        import json
        import torch
        from transformers import AutoModelForCausalLM
        logits = {{}}
        for folder in {[str(f) for f in folders]!r}:
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules") or hasattr(model, "peft_config"), folder
            with torch.no_grad():
                logits[folder] = model(torch.tensor({ids!r})).logits.tolist()
        print("LOGITS " + json.dumps(logits))
        """
    )
    proc = run_python(script, tmp_path)
    assert proc.returncode == 0 and "LOGITS " in proc.stdout, proc.stderr[-3000:]
    remote = json.loads(proc.stdout.split("LOGITS ", 1)[1])
    untrained = KHAForCausalLM.from_pretrained(kha_dir).eval()
    with torch.no_grad():
        start = untrained(torch.tensor(ids)).logits
    seen = []
    for folder in folders:
        # the same checkpoint loaded here with the installed kha_hf classes gives the same logits
        local = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            expected = local(torch.tensor(ids)).logits
        got = torch.tensor(remote[str(folder)])
        assert torch.allclose(got, expected, atol=1e-5), f"{folder.name}: remote-code load differs"
        assert (got - start).abs().max() > 1e-4, f"{folder.name} holds the untrained model (knocks not saved?)"
        seen.append(got)
    assert (seen[0] - seen[1]).abs().max() > 1e-6, "checkpoint-2 and checkpoint-4 are the same model"


def test_runs_under_accelerate_launch_with_one_cpu_process(corpus, kha_dir, tmp_path):
    data, _ = corpus
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--cpu",
        "-m",
        "kha_hf",
        "train",
        str(kha_dir),
        "--output",
        str(tmp_path / "acc"),
        "--data",
        str(data),
        "--max-steps",
        "3",
        "--seq-len",
        "64",
        "--batch-size",
        "2",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_CONFIG_FILE": str(tmp_path / "none.yaml")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held-out loss" in proc.stdout
    assert (tmp_path / "acc" / "model.safetensors").exists()


def test_default_data_is_the_embedded_corpus_with_a_heldout_split(corpus):
    from kha_hf.training.data import train_heldout_split

    _, tokenizer = corpus
    docs = read_documents(None)
    assert len(docs) >= 30 and sum(map(len, docs)) > 4_000_000
    train_set, heldout = train_heldout_split(docs[-3:], tokenizer, 128)
    assert len(heldout) >= 1 and len(train_set) > 10 * len(heldout)
    assert not torch.equal(train_set[len(train_set) - 1]["input_ids"], heldout[0]["input_ids"])


def test_ab_runs_twins_from_the_same_start_and_writes_its_report(tmp_path, capsys):
    import csv
    import json

    from kha_hf.cli import main

    config = tiny_qwen3(vocab_size=300)
    config.save_pretrained(tmp_path / "cfg")
    plays = read_documents(None)[:2]
    (tmp_path / "data.md").write_text("\n".join(p[:40000] for p in plays))
    argv = [
        "ab",
        str(tmp_path / "cfg"),
        "--knock",
        "linear_qkv",
        "--output",
        str(tmp_path / "ab"),
        "--max-steps",
        "6",
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--data",
        str(tmp_path / "data.md"),
    ]
    assert main([*argv, "--seeds", "2", "--seed", "5", "--eval-steps", "3", "--max-eval-blocks", "4"]) == 0
    out = capsys.readouterr().out
    assert "Δ held-out (kha − baseline) over 2 seed(s)" in out and "95 % CI" in out and "1 degree of freedom" in out
    row = next(line for line in out.splitlines() if line.startswith("kha "))  # the table's row of the one twin
    assert "df 1" in row and "→" in row
    rows = list(csv.DictReader(open(tmp_path / "ab" / "loss_curves.csv")))
    assert len(rows) == 12 and set(rows[0]) == {"seed", "step", "baseline_loss", "kha_loss"}
    assert {r["seed"] for r in rows} == {"5", "6"}
    first = {r["seed"]: r for r in rows if r["step"] == "1"}
    # identical start within a seed: identity knocks on a copy of the baseline's initial weights, same first batch
    assert all(r["baseline_loss"] == r["kha_loss"] for r in first.values())
    assert first["5"]["baseline_loss"] != first["6"]["baseline_loss"], "each seed must draw new weights and data"
    assert rows[5]["baseline_loss"] != rows[5]["kha_loss"]
    summary = json.loads((tmp_path / "ab" / "summary.json").read_text())
    deltas = [p["kha_heldout"] - p["baseline_heldout"] for p in summary["per_seed"]]
    assert [p["seed"] for p in summary["per_seed"]] == [5, 6]
    assert [p["delta"] for p in summary["per_seed"]] == pytest.approx(deltas)
    assert summary["delta_mean"] == pytest.approx(sum(deltas) / 2)
    low, high = summary["ci95"]
    assert low < summary["delta_mean"] < high
    assert (tmp_path / "ab" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    for arm in ("baseline", "kha"):  # --eval-steps 3: each run's validation curve, at steps 3 and 6
        curves = [p["validation_curve"] for p in summary["arms"][arm]["per_seed"]]
        assert [[step for step, _ in curve] for curve in curves] == [[3, 6], [3, 6]]
    assert "data: " in out and " / 4 validation / 4 held-out blocks" in out  # --max-eval-blocks 4


def test_resume_continues_from_the_last_checkpoint(corpus, kha_dir, tmp_path):
    data, _ = corpus
    kwargs = dict(data=[str(data)], mode="knocks", save_steps=2, lr=1e-2, **STEPS)
    straight = train(kha_dir, tmp_path / "straight", max_steps=6, **kwargs)
    # an interrupted run: only its checkpoint at step 4 exists
    shutil.copytree(tmp_path / "straight" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    state_file = tmp_path / "resumed" / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    next(h for h in state["log_history"] if h.get("step") == 2 and "loss" in h)["loss"] = 123.0  # a marker
    state_file.write_text(json.dumps(state))
    (tmp_path / "resumed" / ".kha-output").write_text("{}")  # kha wrote it: --resume may replace it
    resumed = train(kha_dir, tmp_path / "resumed", max_steps=6, resume=True, **kwargs)
    assert resumed.steps == 6

    def losses(result):
        return {h["step"]: h["loss"] for h in result.log_history if "loss" in h}

    assert losses(resumed)[2] == 123.0, "steps 1-4 were run again instead of restored"
    # Same data order and optimizer state after resuming: the last steps match the uninterrupted run.
    assert losses(resumed)[6] == pytest.approx(losses(straight)[6], rel=1e-4)
    assert resumed.heldout_loss == pytest.approx(straight.heldout_loss, rel=1e-4)


def test_unreachable_hub_dataset_is_a_clear_error(monkeypatch):
    from kha_hf.common.errors import KHAError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KHAError, match="cannot load dataset 'someone/no-such-corpus'"):
        read_documents(["someone/no-such-corpus"])


def test_blocks_begin_with_bos_where_the_tokenizer_begins_every_encoding_with_it(corpus):
    """Gemma and Llama 3 tokenizers put BOS first and their models use it as the attention sink: every packed block
    then starts with BOS (the stream's tokens follow it, none lost or repeated); a GPT-2 style tokenizer, which adds
    none, gets the plain stream cut into blocks."""
    import copy

    from tokenizers.processors import TemplateProcessing

    from kha_hf.training.data import leading_bos, pack

    _, plain = corpus
    docs = ["To be, or not to be, that is the question", "Whether 'tis nobler in the mind to suffer"]
    eos = plain.eos_token_id
    stream = torch.tensor([t for d in docs for t in [*plain(d, add_special_tokens=False)["input_ids"], eos]])
    assert leading_bos(plain) is None
    assert torch.equal(pack(docs, plain, 4).flatten(), stream[: len(stream) // 4 * 4])

    with_bos = copy.deepcopy(plain)
    with_bos.add_special_tokens({"bos_token": "<bos>"})
    bos = with_bos.bos_token_id
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    assert leading_bos(with_bos) == bos
    blocks = pack(docs, with_bos, 4)
    assert blocks.shape == (len(stream) // 3, 4) and (blocks[:, 0] == bos).all()
    assert torch.equal(blocks[:, 1:].flatten(), stream[: len(stream) // 3 * 3])
    from kha_hf.common.errors import KHAError

    with pytest.raises(KHAError, match="no room beside the tokenizer's BOS"):
        pack(docs, with_bos, 1)
