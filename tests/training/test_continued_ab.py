"""`kha ab --from MODEL`: four arms on one converted checkpoint, each at its own learning rate chosen on a validation
split, a LoRA control of the knocks' size, paired over seeds and blocks, with a forgetting measure."""

import csv
import json

import pytest
import torch

from kha_hf.ab.continued import LR_GRID_FULL, LR_GRID_SMALL, ContinuedAB, continued_ab
from kha_hf.cli import main
from kha_hf.training.data import read_documents, train_validation_heldout_split
from kha_hf.training.modes import lora_targets, matched_lora_rank
from tests.helpers import save_tiny_tokenizer, tiny_base_model, tiny_configs


def test_lora_targets_follow_the_knocks():
    assert lora_targets("mlp_v") == ["v_proj"] and lora_targets("linear_v") == ["v_proj"]
    assert lora_targets("linear_qkv") == ["q_proj", "k_proj", "v_proj"]


def test_matched_rank_by_hand():
    model = tiny_base_model("llama")  # hidden 64, 3 layers, v_proj 64 -> 32 (2 KV heads of 16)
    knock_parameters = 3 * 16**2 * 3  # mlp_v: up, gate, down per layer
    rank, count = matched_lora_rank(model, ["v_proj"], knock_parameters)
    assert (rank, count) == (8, 8 * (64 + 32) * 3) and count == knock_parameters


def test_the_cli_grids_and_arms_are_the_workflows():
    from kha_hf.ab import continued as workflow
    from kha_hf.cli import ab

    assert ab.LR_GRID_FULL == LR_GRID_FULL and ab.LR_GRID_SMALL == LR_GRID_SMALL
    assert (ab.ARMS, ab.DEFAULT_ARMS, ab.ADAPTER_ARMS) == (workflow.ARMS, workflow.DEFAULT_ARMS, workflow.ADAPTER_ARMS)


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
    argv += ["--lr-grid", "1e-3,1e-2", "--lr-grid-full", "1e-4", "--grid-extensions", "0"]
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
    """Every arm through lm-eval: the LoRA, IA3 and OFT merged, the MLP knock adapter as a PeftModel."""
    from kha_hf.ab.continued import ARMS
    from kha_hf.ab.continued_report import COMPARISONS

    settings = tiny_settings(tiny_base, max_steps=2, lr_grid_small=(1e-3,), run_eval=True, limit=2, arms=ARMS)
    summary = continued_ab(settings, output=tmp_path / "out")
    pairs = {(e["arm"], e["control"]): e["rows"] for e in summary["eval"]}
    assert set(pairs) == set(COMPARISONS) and len(pairs) == 5
    for rows in pairs.values():
        assert {r["task"] for r in rows} == {"arc_easy", "piqa", "copa", "winogrande"}
        assert all(r["paired"]["n"] == 2 and "p_holm" in r["paired"] for r in rows)
    assert "kha-knocks vs lora-matched" in (tmp_path / "out" / "eval.md").read_text()
    from kha_hf.eval.paired import recompute

    for arm, control in COMPARISONS:  # each comparison is a kha eval folder whose statistics recompute
        assert recompute(tmp_path / "out" / "eval" / f"{arm}-vs-{control}")["matches"]
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


def test_adapter_arms_compare_the_knock_adapter_with_lora_ia3_and_oft(tiny_base, tmp_path, capsys):
    """`--arms adapters`: the knock adapter on the stock model against PEFT's LoRA (its size), IA3 and OFT (shared
    blocks on o_proj), each tuned on the same grid, paired over seeds and blocks."""
    argv = ["ab", "--from", str(tiny_base / "base"), "--output", str(tmp_path / "out"), "--seeds", "2"]
    argv += ["--max-steps", "3", "--seq-len", "32", "--batch-size", "2", "--data", str(tiny_base / "data.md")]
    argv += ["--lr-grid", "1e-3,1e-2", "--arms", "adapters", "--grid-extensions", "0"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    arms = summary["arms"]
    assert list(arms) == ["knock-adapter", "lora-matched", "ia3", "oft"]
    # sizes by hand (tiny llama: hidden 64, 3 layers, 4 heads of 16, 2 KV heads, MLP 128 wide)
    config = tiny_configs()["llama"]
    layers, head_dim = config.num_hidden_layers, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    assert arms["knock-adapter"]["trainable_parameters"] == arms["lora-matched"]["trainable_parameters"] == 2304
    assert arms["ia3"]["trainable_parameters"] == layers * (kv + kv + config.intermediate_size)  # k, v, down's input
    assert arms["oft"]["trainable_parameters"] == layers * head_dim * (head_dim - 1) // 2  # one shared block
    for key in ("heldout_before", "other_domain_before"):  # each adapter, measured as built, is the stock model
        values = {a[key] for a in arms.values()}
        assert max(values) - min(values) < 1e-6, values
    for arm in arms.values():  # each trained: its held-out loss moved
        assert arm["heldout_after_mean"] != arm["heldout_before"]
    assert summary["adapted_modules"] == {
        "knock-adapter": ["v_proj"],
        "lora-matched": ["v_proj"],
        "ia3": ["down_proj", "k_proj", "v_proj"],
        "oft": ["o_proj"],
    }
    assert not (tmp_path / "out" / "kha").exists()  # no arm starts from a conversion: none is made
    assert summary["parameter_matching"]["exact"]  # the LoRA sized on the knock adapter's count
    assert [t["lr"] for t in summary["tuning"]["oft"]] == [1e-3, 1e-2]
    assert set(summary["at_grid_edge"]) == set(arms) and all(summary["at_grid_edge"].values())  # 2, not extended
    pairs = [(c["arm"], c["control"]) for c in summary["comparisons"]]
    assert pairs == [("knock-adapter", "lora-matched"), ("knock-adapter", "ia3"), ("knock-adapter", "oft")]
    assert all(c["heldout"]["n_seeds"] == 2 for c in summary["comparisons"])
    out = capsys.readouterr().out
    assert "Δ (knock-adapter − oft), held-out:" in out


def test_the_knock_adapter_arm_trains_as_the_converted_models_knocks(tiny_base, tmp_path):
    """The same knocks, the same data, seed and rate: the PEFT knock adapter on the stock model and the knocks of the
    KHA conversion reach the same losses."""
    settings = tiny_settings(tiny_base, max_steps=3, arms=("kha-knocks", "knock-adapter"))
    summary = continued_ab(settings, output=tmp_path / "out")
    adapter, kha = summary["arms"]["knock-adapter"], summary["arms"]["kha-knocks"]
    assert adapter["heldout_after_mean"] != adapter["heldout_before"]
    assert adapter["heldout_after_mean"] == pytest.approx(kha["heldout_after_mean"], abs=1e-5)
    assert adapter["per_seed"][0]["validation"] == pytest.approx(kha["per_seed"][0]["validation"], abs=1e-5)


@pytest.mark.parametrize(
    "arms, message",
    [
        ("lora,ia3", "lora unknown"),
        ("ia3,ia3", "give distinct arms"),
        (",", "give distinct arms"),
        ("adapters,ia3", "'adapters' stands alone"),
    ],
)
def test_bad_arms_are_refused_in_one_line(tmp_path, capsys, arms, message):
    with pytest.raises(SystemExit) as exit_:  # argparse
        main(["ab", "--from", str(tmp_path), "--arms", arms])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_the_ia3_control_outside_pefts_table_uses_the_llama_placement():
    """OLMo 2 is not in peft 0.21's IA3 table: the control scales k, v and down's input, like PEFT's Llama entry; a
    fused qkv_proj (Phi-3) has no value projection to scale and is refused in one line."""
    import torch
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING

    from kha_hf.common.errors import KHAError
    from kha_hf.training.modes import with_ia3
    from tests.helpers import tiny_base_model, tiny_config

    assert "olmo2" not in TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING
    config = tiny_config("olmo2")
    ids = torch.randint(0, config.vocab_size, (1, 9))
    stock = tiny_base_model("olmo2")(ids).logits
    model = with_ia3(tiny_base_model("olmo2"))
    kv = config.num_key_value_heads * config.hidden_size // config.num_attention_heads
    trainable = {n.split(".")[-3]: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"k_proj": kv, "v_proj": kv, "down_proj": config.intermediate_size}
    assert torch.equal(model(ids).logits, stock)  # IA3 starts at scale 1
    with pytest.raises(KHAError, match="phi3 does not have"):
        with_ia3(tiny_base_model("phi3"))


def test_the_oft_control_rotates_whole_heads_also_under_mla():
    """DeepSeek-V3's MLA: o_proj's input is heads x v_head_dim (narrower than the query/key heads); the shared OFT
    block is one value head wide, so it rotates within heads. It starts as the identity."""
    import torch

    from kha_hf.training.modes import with_shared_oft
    from tests.helpers import tiny_base_model, tiny_config

    config = tiny_config("deepseek_v3")
    assert config.v_head_dim != config.qk_nope_head_dim + config.qk_rope_head_dim
    ids = torch.randint(0, config.vocab_size, (1, 9))
    stock = tiny_base_model("deepseek_v3")(ids).logits
    model = with_shared_oft(tiny_base_model("deepseek_v3"))
    layer = model.base_model.model.model.layers[0].self_attn.o_proj
    rotation = layer.oft_R["default"]
    assert rotation.block_size == config.v_head_dim and rotation.block_share and rotation.weight.shape[0] == 1
    assert torch.allclose(model(ids).logits, stock, atol=1e-5)


def test_a_best_rate_on_the_grids_edge_is_followed_beyond_it(tiny_base, tmp_path):
    """Rates far too small for 3 steps: the knocks' best is the grid's top, so the tuning tries one grid step further
    (x2 here) until grid_extensions runs out; the best rate is then the last one tried, still flagged at the edge."""
    settings = tiny_settings(
        tiny_base, max_steps=3, arms=("knock-adapter",), lr_grid_small=(1e-6, 2e-6), grid_extensions=2
    )
    summary = continued_ab(settings, output=tmp_path / "out")
    tried = summary["tuning"]["knock-adapter"]
    assert [t["lr"] for t in tried] == pytest.approx([1e-6, 2e-6, 4e-6, 8e-6])
    losses = [t["validation_loss"] for t in tried]
    assert losses == sorted(losses, reverse=True)  # each step up helped: that is why the search went on
    assert summary["chosen_lr"]["knock-adapter"] == pytest.approx(8e-6)
    assert summary["at_grid_edge"] == {"knock-adapter": True} and summary["grid_extensions"] == 2


def test_an_interior_best_rate_ends_the_tuning_at_the_grid():
    from kha_hf.ab.continued import _at_edge, _beyond_the_edge

    tried = [{"lr": lr, "validation_loss": 1.0} for lr in (1e-3, 3e-3, 1e-2)]
    assert _beyond_the_edge(tried, 3e-3) == [] and not _at_edge(tried, 3e-3)
    assert _beyond_the_edge(tried, 1e-2) == pytest.approx([1e-2 * 1e-2 / 3e-3]) and _at_edge(tried, 1e-2)
    assert _beyond_the_edge(tried, 1e-3) == pytest.approx([1e-3 * 1e-3 / 3e-3])
    assert _beyond_the_edge(tried[:1], 1e-3) == []  # one rate: no step to take


def test_an_adapter_that_does_not_start_as_the_identity_shows_in_its_before_loss(tiny_base, tmp_path, monkeypatch):
    """Each arm's starting losses are measured on that arm as built, not copied from the base: an IA3 whose scales
    start at 3 instead of 1 reports a different starting loss."""
    import torch

    import kha_hf.training.modes as modes

    honest = modes.with_ia3

    def scaled_ia3(model):
        model = honest(model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "ia3_l" in name:
                    param.fill_(3.0)
        return model

    monkeypatch.setattr(modes, "with_ia3", scaled_ia3)
    summary = continued_ab(tiny_settings(tiny_base, arms=("lora-matched", "ia3")), output=tmp_path / "out")
    arms = summary["arms"]
    assert abs(arms["ia3"]["heldout_before"] - arms["lora-matched"]["heldout_before"]) > 1e-3


def test_an_arm_without_trainable_parameters_or_with_every_rate_diverging_is_refused(tiny_base, tmp_path, monkeypatch):
    import kha_hf.training.modes as modes
    from kha_hf.common.errors import KHAError

    with pytest.raises(KHAError, match="every rate tried for knock-adapter diverged"):
        settings = tiny_settings(tiny_base, arms=("knock-adapter",), lr_grid_small=(1e30,))
        continued_ab(settings, output=tmp_path / "nan")
    assert not (tmp_path / "nan").exists()
    honest = modes.with_shared_oft
    monkeypatch.setattr(modes, "with_shared_oft", lambda model: honest(model).requires_grad_(False))
    with pytest.raises(KHAError, match="the oft arm has no trainable parameters"):
        continued_ab(tiny_settings(tiny_base, arms=("oft",)), output=tmp_path / "frozen")


def test_options_of_continued_training_are_refused_without_from(capsys):
    assert main(["ab", "--arms", "oft", "--max-steps", "1"]) == 2
    assert "--arms applies only with --from MODEL" in capsys.readouterr().err
    assert main(["ab", "--eval", "--lr-grid", "1e-3"]) == 2
    assert "--lr-grid, --eval apply only with --from MODEL" in capsys.readouterr().err
    assert main(["ab", "--from", "somewhere", "--bf16"]) == 2
    assert "--bf16 is not used with --from" in capsys.readouterr().err


def test_the_oft_control_stays_orthogonal_at_any_weight():
    """peft 0.21's default Neumann series drifts from orthogonal as the weights grow (as training at a tuned rate
    makes them); the control uses the exact Cayley transform, orthogonal for any weight."""
    import torch

    from kha_hf.training.modes import with_shared_oft
    from tests.helpers import tiny_base_model

    model = with_shared_oft(tiny_base_model("llama"))
    rotation = model.base_model.model.model.layers[0].self_attn.o_proj.oft_R["default"]
    with torch.no_grad():
        rotation.weight.copy_(torch.randn_like(rotation.weight) * 3)
        block = rotation._cayley_batch(
            rotation.weight, rotation.block_size, rotation.use_cayley_neumann, rotation.num_cayley_neumann_terms
        )[0]
    eye = torch.eye(rotation.block_size)
    assert torch.allclose(block @ block.T, eye, atol=1e-4)


def test_a_restarted_ab_reuses_the_runs_in_its_run_cache(tiny_base, tmp_path, capsys, monkeypatch):
    """A stopped A/B started again with the same --run-cache continues where it stopped: every finished run is
    read back (no training), the summary's numbers are the first run's; other settings train again, and a broken
    cache file is ignored in one line, never trusted."""
    from kha_hf.ab import continued as workflow

    settings = dict(arms=("knock-adapter", "lora-matched"), seeds=2, run_cache=str(tmp_path / "cache"))
    first = continued_ab(tiny_settings(tiny_base, **settings), output=tmp_path / "first")
    files = sorted((tmp_path / "cache").glob("*.json"))
    assert len(files) == 4 and not list((tmp_path / "cache").glob(".*")), files  # 2 arms x (1 tuning rate, 2 seeds)

    def no_training(*args, **kwargs):
        raise AssertionError("a cached run was trained again")

    monkeypatch.setattr(workflow, "train_arm", no_training)
    capsys.readouterr()
    again = continued_ab(tiny_settings(tiny_base, **settings), output=tmp_path / "again")
    assert capsys.readouterr().out.count("run cache: ") == 4
    assert again["runs_reused_from_cache"] == 4 and "runs_reused_from_cache" not in first
    for key in ("arms", "comparisons", "tuning", "chosen_lr"):
        assert again[key] == first[key], key
    monkeypatch.undo()
    (lost,) = [f for f in files if "-lora-matched-seed1-" in f.name]  # a stop before the last run: it trains now
    lost.unlink()
    resumed = continued_ab(tiny_settings(tiny_base, **settings), output=tmp_path / "resumed")
    assert resumed["runs_reused_from_cache"] == 3 and lost.exists()
    assert resumed["comparisons"] == first["comparisons"]  # the same numbers as the uninterrupted run

    monkeypatch.setattr(workflow, "train_arm", no_training)
    with pytest.raises(AssertionError, match="trained again"):  # another step count: nothing reused
        continued_ab(tiny_settings(tiny_base, **settings, max_steps=3), output=tmp_path / "other")
    capsys.readouterr()
    for hostile in (
        '{"key": "0", "arm": "x"}',  # not this run's
        json.dumps({**json.loads(files[0].read_text()), "trainable_parameters": "2304"}),  # its key, a wrong type
        json.dumps({**json.loads(files[0].read_text()), "curve": [[1e400, 1.0]]}),  # Infinity as a step
        "[" * 100000,  # nested too deep for the parser
    ):
        files[0].write_text(hostile)
        with pytest.raises(AssertionError, match="trained again"):  # ignored, so that run trains again
            continued_ab(tiny_settings(tiny_base, **settings), output=tmp_path / "broken")
        assert f"run cache: ignoring {files[0]} (" in capsys.readouterr().out


def test_the_run_cache_follows_the_weights_not_their_path(tiny_base, tmp_path, monkeypatch):
    """The same weights under another path are reused; other weights at that path (same file size, even the same
    modification time) are not: a run's key holds its arm's losses before training, not file stamps."""
    import os
    import shutil

    from transformers import AutoModelForCausalLM

    from kha_hf.ab import continued as workflow

    settings = dict(arms=("knock-adapter",), run_cache=str(tmp_path / "cache"))
    continued_ab(tiny_settings(tiny_base, **settings), output=tmp_path / "first")
    shutil.copytree(tiny_base / "base", tmp_path / "copy")

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(workflow, "train_arm", no_training)

    def from_copy():
        settings_ = tiny_settings(tiny_base, **settings)
        settings_.model = str(tmp_path / "copy")
        return settings_

    assert continued_ab(from_copy(), output=tmp_path / "moved")["runs_reused_from_cache"] == 1
    weights = tmp_path / "copy" / "model.safetensors"
    stamp = weights.stat()
    config = tiny_configs()["llama"]
    config.vocab_size = 300
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    shutil.copyfile(tmp_path / "other" / "model.safetensors", weights)
    os.utime(weights, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert weights.stat().st_size == stamp.st_size
    with pytest.raises(AssertionError, match="trained again"):
        continued_ab(from_copy(), output=tmp_path / "swapped")


def test_the_run_cache_never_writes_through_a_link_and_keys_the_code(tmp_path, monkeypatch):
    from kha_hf.ab import cache as run_cache
    from kha_hf.ab.arm import ArmRun

    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    cache = run_cache.RunCache(tmp_path / "c", {"blocks": "x"}, {"knock-adapter": {"before": [1.0]}}, steps=2)
    cache.folder.mkdir()
    run = ArmRun(
        "knock-adapter",
        0,
        [(1, 2.0)],
        2.0,
        2.0,
        lr=1e-3,
        validation_loss=2.0,
        heldout_blocks=[2.0],
        other_blocks=[3.0],
        trainable_parameters=5,
        wall_seconds=1.0,
        flops=1.0,
    )
    path = cache.path("knock-adapter", 0, 1e-3)
    path.symlink_to(victim)
    assert cache.get("knock-adapter", 0, 1e-3, (1, 1)) is None  # a link is not read
    cache.put(run)
    assert victim.read_text() == "untouched" and not path.is_symlink()
    assert cache.get("knock-adapter", 0, 1e-3, (1, 1)).heldout_blocks == [2.0]

    package = tmp_path / "pkg"
    for name in ("modeling/a.py", "serving/b.py", "ab/continued.py"):
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("x = 1\n")
    monkeypatch.setattr(run_cache, "PACKAGE", package)
    digest = run_cache.code_digest()
    (package / "serving/b.py").write_text("x = 2\n")  # not code that trains or measures
    assert run_cache.code_digest() == digest
    (package / "modeling/a.py").write_text("x = 2\n")
    assert run_cache.code_digest() != digest


def test_the_run_cache_stays_out_of_a_gguf_files_folder(tmp_path):
    from kha_hf.ab.cache import check_cache_dir
    from kha_hf.common.errors import KHAError

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(KHAError, match="inside the model file's folder"):
        check_cache_dir(tmp_path / "cache", tmp_path / "out", str(tmp_path / "m.gguf"))
    with pytest.raises(KHAError, match="needs a folder"):
        check_cache_dir("", tmp_path / "out", str(tmp_path / "m.gguf"))
    assert not (tmp_path / "cache").exists()


def test_the_run_cache_is_never_written_into_the_output_or_the_model(tiny_base, tmp_path, capsys):
    from kha_hf.common.errors import KHAError

    for folder in (tmp_path / "out" / "cache", tiny_base / "base" / "cache"):
        with pytest.raises(KHAError, match="--run-cache .* is inside"):
            continued_ab(tiny_settings(tiny_base, run_cache=str(folder)), output=tmp_path / "out")
        assert not folder.exists()
    assert main(["ab", "--run-cache", str(tmp_path / "c")]) == 2
    assert "--run-cache applies only with --from MODEL" in capsys.readouterr().err
