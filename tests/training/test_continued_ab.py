"""`kha ab --from MODEL`: four arms on one converted checkpoint, each at its own learning rate chosen on a validation
split, a LoRA control of the knocks' size, paired over seeds and blocks, with a forgetting measure."""

import csv
import json

import pytest

from kha_hf.cli import main
from kha_hf.training.data import read_documents, train_validation_heldout_split
from kha_hf.training.modes import lora_targets, matched_lora_rank
from kha_hf.workflows.continued_ab import LR_GRID_FULL, LR_GRID_SMALL, ContinuedAB, continued_ab
from tests.helpers import save_tiny_tokenizer, tiny_base_model, tiny_configs


def test_lora_targets_follow_the_knocks():
    assert lora_targets("mlp_v") == ["v_proj"] and lora_targets("linear_v") == ["v_proj"]
    assert lora_targets("linear_qkv") == ["q_proj", "k_proj", "v_proj"]


def test_matched_rank_by_hand():
    model = tiny_base_model("llama")  # hidden 64, 3 layers, v_proj 64 -> 32 (2 KV heads of 16)
    knock_parameters = 3 * 16**2 * 3  # mlp_v: up, gate, down per layer
    rank, count = matched_lora_rank(model, ["v_proj"], knock_parameters)
    assert (rank, count) == (8, 8 * (64 + 32) * 3) and count == knock_parameters


def test_the_cli_grids_are_the_workflows():
    from kha_hf.cli import ab

    assert ab.LR_GRID_FULL == LR_GRID_FULL and ab.LR_GRID_SMALL == LR_GRID_SMALL


def test_train_validation_and_heldout_never_share_a_block(corpus):
    _, tokenizer = corpus
    train, validation, heldout = train_validation_heldout_split(read_documents(None)[:2], tokenizer, 64)
    rows = [tuple(t.tolist()) for split in (train, validation, heldout) for t in split.blocks]
    assert len(rows) == len(set(rows)) or len(set(rows)) >= len(rows) - 2  # (repeated text could repeat a block)
    assert len(validation) == len(heldout) >= 1


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("continued")
    config = tiny_configs()["llama"]
    config.vocab_size = 300  # the tiny tokenizer's ids
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "base")
    save_tiny_tokenizer(root / "base")
    text = read_documents(None)[0][:24000]
    (root / "data.md").write_text(text)
    return root


def tiny_settings(tiny_base, **overrides) -> ContinuedAB:
    """One seed of a few steps on the tiny model and its text (the full-training grid: one rate)."""
    settings = dict(max_steps=2, seq_len=32, batch_size=2, seeds=1, lr_grid_full=(1e-4,), lr_grid_small=(1e-3,))
    return ContinuedAB(str(tiny_base / "base"), data=[str(tiny_base / "data.md")], **{**settings, **overrides})


def test_continued_ab_tunes_each_arm_and_reports_paired_intervals(tiny_base, tmp_path, capsys):
    argv = ["ab", "--from", str(tiny_base / "base"), "--output", str(tmp_path / "out"), "--seeds", "2"]
    argv += ["--max-steps", "3", "--seq-len", "32", "--batch-size", "2", "--data", str(tiny_base / "data.md")]
    argv += ["--lr-grid", "1e-3,1e-2", "--lr-grid-full", "1e-4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "trainable parameters: knocks 2,304; LoRA r=8 on v_proj: 2,304 (exact match)" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    arms = summary["arms"]
    assert set(arms) == {"base-full", "kha-full", "kha-knocks", "lora-matched"}
    assert summary["parameter_matching"]["exact"] and summary["parameter_matching"]["relative_difference"] == 0
    # tuning: every rate of each arm's grid was tried on the validation split, the best one kept
    for arm, tried in summary["tuning"].items():
        grid = [1e-4] if arm.endswith("-full") else [1e-3, 1e-2]
        assert [t["lr"] for t in tried] == grid
        best = min(tried, key=lambda t: t["validation_loss"])
        assert summary["chosen_lr"][arm] == arms[arm]["lr"] == best["lr"]
    assert arms["kha-knocks"]["trainable_parameters"] == arms["lora-matched"]["trainable_parameters"] == 2304
    assert arms["kha-full"]["trainable_parameters"] == arms["base-full"]["trainable_parameters"] + 2304
    for arm in arms.values():  # cost: FLOPs estimate and wall time for each seed
        assert arm["training_flops_estimate"] > 0 and len(arm["wall_seconds"]) == 2
    # the converted model computes what the base computes: identical losses before training for all four arms
    for key in ("heldout_before", "other_domain_before"):
        values = {a[key] for a in arms.values()}
        assert max(values) - min(values) < 1e-6, values
    assert "Wikipedia" in summary["data"]["other_domain"] and summary["data"]["other_domain_blocks"] > 0
    comparisons = {(c["arm"], c["control"]): c for c in summary["comparisons"]}
    for comparison in comparisons.values():
        for split in ("heldout", "other_domain"):
            entry = comparison[split]
            assert (
                entry["n_seeds"] == 2
                and entry["n_blocks"]
                == summary["data"]["heldout_blocks" if split == "heldout" else "other_domain_blocks"]
            )
            assert entry["ci95"] is None or entry["ci95"][0] <= entry["delta_mean"] <= entry["ci95"][1]
            per_seed = [p["delta"] for p in entry["per_seed"]]
            assert entry["delta_mean"] == pytest.approx(sum(per_seed) / 2)
    assert "what varies per seed" not in summary and "data order" in summary["varies_per_seed"]
    rows = list(csv.DictReader(open(tmp_path / "out" / "loss_curves.csv")))
    assert set(rows[0]) == {"seed", "step", "base-full_loss", "kha-full_loss", "kha-knocks_loss", "lora-matched_loss"}
    assert (tmp_path / "out" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_learning_rate_choice_ignores_the_heldout_split(tiny_base, tmp_path, monkeypatch):
    """Poisoning the held-out split (its blocks replaced by random tokens) changes the reported held-out losses but
    not a single chosen learning rate or validation loss: the choice sees the validation split only."""
    import torch

    import kha_hf.training.data as data_module

    split = data_module.train_validation_heldout_split

    def poisoned_split(*args, **kwargs):
        train, validation, heldout = split(*args, **kwargs)
        heldout.blocks = torch.randint(3, 300, heldout.blocks.shape, generator=torch.Generator().manual_seed(0))
        return train, validation, heldout

    results = []
    for name in ("clean", "poisoned"):
        if name == "poisoned":
            monkeypatch.setattr(data_module, "train_validation_heldout_split", poisoned_split)
        settings = tiny_settings(tiny_base, max_steps=3, lr_grid_small=(1e-3, 3e-2))
        results.append(continued_ab(settings, output=tmp_path / name))
    clean, poisoned = results
    assert clean["chosen_lr"] == poisoned["chosen_lr"]
    assert clean["tuning"] == poisoned["tuning"]
    assert clean["arms"]["kha-knocks"]["heldout_before"] != poisoned["arms"]["kha-knocks"]["heldout_before"]


def test_continued_ab_eval_adds_paired_downstream_statistics(tiny_base, tmp_path):
    settings = tiny_settings(tiny_base, max_steps=2, lr_grid_small=(1e-3,), run_eval=True, limit=2)
    summary = continued_ab(settings, output=tmp_path / "out")
    pairs = {(e["arm"], e["control"]): e["rows"] for e in summary["eval"]}
    assert set(pairs) == {("kha-full", "base-full"), ("kha-knocks", "lora-matched")}
    for rows in pairs.values():
        assert {r["task"] for r in rows} == {"arc_easy", "piqa", "copa", "winogrande"}
        assert all(r["paired"]["n"] == 2 and "p_holm" in r["paired"] for r in rows)
    assert "kha-knocks vs lora-matched" in (tmp_path / "out" / "eval.md").read_text()
    one = summary["comparisons"][0]["heldout"]
    assert one["ci95"] is None and one["excludes_zero"] is None  # one seed: no interval, no verdict


def test_from_takes_a_preset_for_its_size_but_not_a_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["ab", str(tmp_path / "config.json"), "--from", str(tmp_path)]) == 2
    assert "with --from, the positional argument is a preset" in capsys.readouterr().err


@pytest.mark.parametrize("grid", ["0", "-1e-3", "abc", ","])
def test_bad_learning_rate_grids_are_one_line_errors(tmp_path, capsys, grid):
    with pytest.raises(SystemExit) as exit_info:
        main(["ab", "--from", str(tmp_path), "--lr-grid", grid])
    assert exit_info.value.code == 2 and "--lr-grid" in capsys.readouterr().err
