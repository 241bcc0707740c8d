"""`kha ab PRESET --variants ...`: the paper's ablation in one command (one baseline, every variant a twin on the same
initial weights, data order and seeds), its table and stability numbers, its run cache, and its one-line errors."""

from __future__ import annotations

import csv
import json

import pytest

import kha_hf.ab.cache as ab_cache
import kha_hf.ab.scratch as ab_module
from kha_hf.cli import main
from kha_hf.training.data import read_documents
from tests.cli.test_bad_input import one_line_error
from tests.helpers import run_python, tiny_config

STEPS = ["--max-steps", "4", "--seq-len", "32", "--batch-size", "4", "--logit-every", "2"]


@pytest.fixture
def setup(tmp_path):
    config = tiny_config("qwen3", vocab_size=300)
    config.save_pretrained(tmp_path / "cfg")
    (tmp_path / "data.md").write_text(read_documents(None)[0][:30000])
    return ["ab", str(tmp_path / "cfg"), "--data", str(tmp_path / "data.md"), *STEPS, "--seeds", "2"]


def test_one_baseline_and_every_variant_on_the_same_start(setup, tmp_path, capsys):
    out = tmp_path / "ab"
    argv = [*setup, "--variants", "mlp_v,gate_v,mlp_qkv,mlp_v_random", "--output", str(out), "--save-models"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("arm "))
    assert "95 % CI (t)" in header and "paper Δ (A0.8B-6.6B MoE, 75B tokens)" in header
    assert "Δ = arm − baseline (negative: lower loss than the baseline)" in printed
    rows = {
        line.split()[0]: line
        for line in printed.splitlines()
        if line.split()[:1] and line.split()[0] in ("mlp_v", "gate_v", "mlp_qkv", "mlp_v_random")
    }
    assert rows["mlp_v"].endswith("-0.024") and rows["gate_v"].endswith("+0.063")
    assert rows["mlp_v_random"].endswith("higher (no number)")
    summary_now = json.loads((out / "summary.json").read_text())
    for name, row in rows.items():  # each row: the arm's loss, Δ, its interval with df, base → arm spikes and norms
        entry, arms = summary_now["variants"][name], summary_now["stability"]["arms"]
        assert row.split()[1:3] == [
            f"{summary_now['arms'][name]['heldout_loss_mean']:.4f}",
            f"{entry['delta_mean']:+.4f}",
        ]
        assert "df 1" in row or "none: no spread" in row
        assert f"{arms['baseline']['spikes_mean']:.1f} → {arms[name]['spikes_mean']:.1f}" in row
        assert f"{arms['baseline']['max_grad_norm_mean']:.3g} → {arms[name]['max_grad_norm_mean']:.3g}" in row
    baseline_row = next(
        line for line in printed.splitlines() if line.split()[:1] == ["baseline"] and len(line.split()) == 2
    )
    assert f"{summary_now['arms']['baseline']['heldout_loss_mean']:.4f}" in baseline_row
    seeds = printed[printed.index("held-out loss per seed") :].splitlines()
    assert seeds[1].split() == ["seed", "baseline", "mlp_v", "gate_v", "mlp_qkv", "mlp_v_random"]
    per_seed = {p["seed"]: p for p in summary_now["arms"]["gate_v"]["per_seed"]}
    assert seeds[3].split()[0] == "1" and seeds[3].split()[3] == f"{per_seed[1]['heldout_loss']:.4f}"
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["variants"]) == ["mlp_v", "gate_v", "mlp_qkv", "mlp_v_random"]
    for name, entry in summary["variants"].items():
        deltas = [p[f"{name}_heldout"] - p["baseline_heldout"] for p in entry["per_seed"]]
        assert entry["delta_mean"] == pytest.approx(sum(deltas) / 2)
    assert summary["variants"]["mlp_v_random"]["knock_init"] == "random"
    curves = list(csv.DictReader(open(out / "loss_curves.csv")))
    first = [r for r in curves if r["step"] == "1"]
    for r in first:  # identity twins start where the baseline starts (same weights, same first batch)
        assert r["baseline_loss"] == r["mlp_v_loss"] == r["gate_v_loss"] == r["mlp_qkv_loss"]
        assert r["mlp_v_random_loss"] != r["baseline_loss"]  # random knocks: another function at step 1
    assert first[0]["baseline_loss"] != first[1]["baseline_loss"]  # each seed its own weights and data
    stability = list(csv.DictReader(open(out / "stability.csv")))
    assert len(stability) == 5 * 2 * 4 and {r["arm"] for r in stability} == {"baseline", *summary["variants"]}
    assert all(r["max_logit_layer0"] for r in stability if r["step"] in ("1", "2", "4"))
    arms = summary["stability"]["arms"]
    assert set(arms) == {"baseline", *summary["variants"]}
    assert arms["baseline"]["max_grad_norm_mean"] > 0 and "spikes_delta" in arms["gate_v"]
    assert "median of the previous 100 steps" in summary["stability"]["spike_definition"]
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    # --save-models: each trained model, loadable, with the held-out loss the summary reports
    saved = sorted(p.name for p in (out / "models").iterdir())
    assert saved == sorted(f"{arm}-seed{s}" for arm in ("baseline", *summary["variants"]) for s in (0, 1))
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out / "models" / "baseline-seed0").model_type == "qwen3"
    gate = json.loads((out / "models" / "gate_v-seed1" / "config.json").read_text())
    assert (gate["model_type"], gate["knock_v"]) == ("kha", "gate")
    random = json.loads((out / "models" / "mlp_v_random-seed1" / "config.json").read_text())
    assert random["knock_init"] == "random"


def test_an_interrupted_ablation_trains_only_what_is_missing(setup, tmp_path, capsys, monkeypatch):
    out = tmp_path / "ab"
    argv = [*setup, "--variants", "mlp_v,linear_v", "--output", str(out), "--seeds", "1"]
    # a run cut after two finished runs, in its own process (a kept folder whose process still runs is never taken)
    script = f"""
import sys
import kha_hf.ab.scratch as ab
real, done = ab._train_one, []
def cut_after_two(model, name, *args, **kwargs):
    if len(done) == 2:
        raise RuntimeError("power cut")
    done.append(name)
    return real(model, name, *args, **kwargs)
ab._train_one = cut_after_two
from kha_hf.cli import main
sys.exit(main({argv!r}))
"""
    proc = run_python(script, tmp_path, without_kha_hf=False)
    assert proc.returncode != 0 and "power cut" in proc.stderr, proc.stderr[-2000:]
    assert "the same kha ab command again reuses its finished runs" in proc.stdout
    assert not out.exists()
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".kha-")]
    assert len(kept) == 1 and len(list((kept[0] / "runs").glob("*.json"))) == 2
    cached = json.loads((kept[0] / "runs" / "baseline-seed0.json").read_text())
    # other settings: the kept runs would not pair with new ones
    other = [("5" if a == "4" and argv[i - 1] == "--max-steps" else a) for i, a in enumerate(argv)]
    err = one_line_error(capsys, other, "ab")
    assert "with other settings" in err and kept[0].exists()
    trained = []
    real = ab_module._train_one
    monkeypatch.setattr(
        ab_module, "_train_one", lambda m, name, *a, **k: trained.append(name) or real(m, name, *a, **k)
    )
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "run cache: reusing the 2 finished runs" in printed
    assert printed.count("taken from the run cache") == 2 and trained == ["linear_v"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["arms"]["baseline"]["per_seed"][0]["heldout_loss"] == cached["heldout_loss"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".kha-")]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--variants", "mlp_v,conv_v"], "unknown variant 'conv_v'"),
        (["--variants", "gate_v_random"], "unknown variant 'gate_v_random'"),
        (["--variants", "mlp_v,linear_v,mlp_v"], "variant 'mlp_v' is named twice"),
        (["--spike-margin", "0"], "--spike-margin: must be"),
        (["--spike-margin", "nan"], "--spike-margin"),
        (["--variants", "mlp_v", "--knock", "linear_v"], "--variants names every twin"),
        (["--variants", "mlp_v", "--from", "x"], "--variants, --logit-every apply to from-scratch runs only"),
        (["--spike-margin", "0.2", "--from", "x"], "--logit-every, --spike-margin apply to from-scratch runs only"),
    ],
)
def test_bad_ablation_input_is_one_line(setup, tmp_path, capsys, extra, says):
    err = one_line_error(capsys, [*setup, "--output", str(tmp_path / "o"), *extra], "ab")
    assert says in err
    assert not (tmp_path / "o").exists()


def test_a_variant_the_base_cannot_take_is_refused_before_any_data_is_read(tmp_path, capsys):
    config = tiny_config("deepseek_v3")
    config.save_pretrained(tmp_path / "mla")
    argv = ["ab", str(tmp_path / "mla"), "--variants", "linear_v,mlp_q", "--output", str(tmp_path / "o")]
    err = one_line_error(capsys, [*argv, "--data", str(tmp_path / "missing.md")], "ab")
    assert "variant mlp_q:" in err and "multi-head latent attention" in err


def test_a_kept_run_reads_back_and_one_kha_did_not_write_is_refused(tmp_path):
    import math

    from kha_hf.ab.arm import ArmRun
    from kha_hf.ab.stability import run_stability
    from kha_hf.common.errors import KHAError

    nan = float("nan")
    rows = [{"step": s, "loss": 3.0, "grad_norm": 1.0} for s in range(1, 13)] + [{"step": 13, "loss": nan}]
    ab_cache.keep(tmp_path, ArmRun("baseline", 0, [(1, nan), (2, 3.0)], nan, 4.0, stability=rows))
    back = ab_cache.cached(tmp_path, "baseline", 0)  # a diverged run: NaN kept as null, read back as NaN
    assert math.isnan(back.curve[0][1]) and math.isnan(back.train_loss) and back.heldout_loss == 4.0
    assert run_stability(back)["spike_steps"] == [13]  # the NaN step is a spike
    assert ab_cache.cached(tmp_path, "baseline", 1) is None  # not kept: trained
    path = tmp_path / "runs" / "baseline-seed0.json"
    kept = json.loads(path.read_text())
    for bad in (
        {**kept, "curve": []},
        {**kept, "heldout_loss": "nan"},
        {**kept, "stability": [{}]},
        {**kept, "stability": [{"step": 1, "loss": "x"}]},
        {**kept, "stability": [{**rows[0], "max_logit": [[1]]}]},
        {**kept, "extra": 1},
        {**kept, "seed": 5},
        [1],
        {**kept, "curve": [["x", 1]]},
        {**kept, "stability": 3},
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(KHAError, match="is not a run kha ab kept"):
            ab_cache.cached(tmp_path, "baseline", 0)
    path.unlink()
    path.mkdir()
    with pytest.raises(KHAError, match="not a regular file"):
        ab_cache.cached(tmp_path, "baseline", 0)


def test_continued_training_refuses_the_gate_control(tmp_path, capsys):
    argv = ["ab", "--from", str(tmp_path / "no-model"), "--knock", "gate_v", "--output", str(tmp_path / "o")]
    err = one_line_error(capsys, argv, "ab")
    assert "--knock gate_v is the gate-only value knock" in err and "kha ab --from takes the paper's knocks" in err


def test_the_loss_plot_marks_each_spike_at_its_step_and_loss(tmp_path, monkeypatch):
    from kha_hf.ab import report as ab_report
    from kha_hf.ab.arm import ArmRun
    from kha_hf.ab.stability import stability_summary

    losses = [3.0] * 30
    losses[20] = 4.0
    rows = [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]
    runs = [ArmRun("baseline", 0, [(i + 1, x) for i, x in enumerate(losses)], 3.0, 3.0, stability=rows)]
    summary = stability_summary(runs)
    assert summary["arms"]["baseline"]["per_seed"][0]["spike_steps"] == [21]
    assert ab_report._spike_marks(runs, summary["arms"]["baseline"]) == [(21, 4.0)]
    ab_report.plot_mean_curves(runs, tmp_path / "p.png", "t", summary)
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
