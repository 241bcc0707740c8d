"""`kha fold` gives a stock checkpoint with the KHA model's outputs; `kha inspect` reports the knocks exactly."""

import json
import os
import textwrap

import pytest
import torch

from kha_hf import KHAForCausalLM
from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.conversion.fold import fold
from kha_hf.conversion.knock_stats import knock_heatmaps, knock_statistics
from tests.helpers import FAMILIES, assert_close, randomize_knocks, run_python, tiny_base_model


def _trained(family: str, knock: str, tmp_path, shard: str = "1GB"):
    kha = KHAForCausalLM.from_base(tiny_base_model(family), knock=knock)
    randomize_knocks(kha)
    kha.save_pretrained(tmp_path / "kha", max_shard_size=shard)
    return kha


@pytest.mark.parametrize("family", FAMILIES)
def test_folded_linear_qkv_matches_kha_in_stock_transformers(family, tmp_path):
    kha = _trained(family, "linear_qkv", tmp_path, shard="80KB")
    result = fold(tmp_path / "kha", tmp_path / "folded", progress=False)
    config = json.loads((result.output / "config.json").read_text())
    assert config["model_type"] == kha.config.base_model_type and "auto_map" not in config
    assert config["architectures"][0].endswith("ForCausalLM") and not config["architectures"][0].startswith("KHA")
    assert not [f for f in os.listdir(result.output) if f.endswith(".py")]
    index = json.loads((result.output / "model.safetensors.index.json").read_text())["weight_map"]
    assert not [k for k in index if "_knock." in k]

    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        expected = kha(ids).logits
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    prompt = ids[:1, :5]
    kha_tokens = kha.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch.save(kha_tokens, tmp_path / "tokens.pt")
    # A fresh process without kha_hf and without trust_remote_code: a plain transformers model.
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(result.output)!r}, attn_implementation="eager")
        assert type(model).__module__.startswith("transformers.models."), type(model)
        e = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            diff = (model(e["ids"]).logits - e["logits"]).abs().max().item()
        assert diff <= 1e-5, diff
        tokens = torch.load({str(tmp_path / "tokens.pt")!r})
        got = model.generate(e["ids"][:1, :5], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(got, tokens), (got, tokens)
        print("FOLD_OK", diff)
        """
    )
    out = run_python(script, tmp_path)
    assert out.returncode == 0 and "FOLD_OK" in out.stdout, out.stdout + out.stderr


def test_mlp_knock_is_refused_with_an_explanation(tmp_path, capsys):
    _trained("qwen3", "mlp_v", tmp_path)
    assert main(["fold", str(tmp_path / "kha"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "non-linear and cannot be folded" in err
    assert not (tmp_path / "out").exists()


def test_partial_fold_keeps_the_value_mlp(tmp_path):
    kha = _trained("qwen3", "mlp_v_linear_qk", tmp_path)
    with pytest.raises(KHAError, match="--partial"):
        fold(tmp_path / "kha", tmp_path / "out", progress=False)
    result = fold(tmp_path / "kha", tmp_path / "out", partial=True, progress=False)
    config = json.loads((result.output / "config.json").read_text())
    assert (config["model_type"], config["knock_q"], config["knock_k"], config["knock_v"]) == (
        "kha",
        "none",
        "none",
        "mlp",
    )
    # the card names the knock that remains (a reused variable once put the shard's tensor names there)
    assert "a KHA checkpoint whose V MLP remains" in (result.output / "README.md").read_text()
    partial = KHAForCausalLM.from_pretrained(result.output)
    assert partial.model.layers[0].self_attn.q_knock is None
    ids = torch.randint(3, 128, (2, 10))
    with torch.no_grad():
        assert_close(partial(ids).logits, kha(ids).logits, atol=1e-5)


def test_partial_fold_of_a_model_without_an_mlp_knock_is_one_line(tmp_path, capsys):
    _trained("llama", "linear_v", tmp_path)
    capsys.readouterr()  # the fixture's progress bars
    assert main(["fold", str(tmp_path / "kha"), str(tmp_path / "out"), "--partial"]) == 2
    err = capsys.readouterr().err
    assert "--partial keeps an MLP knock, and this model has none" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_fold_copies_untouched_shards_byte_for_byte(tmp_path):
    _trained("llama", "linear_v", tmp_path, shard="40KB")
    result = fold(tmp_path / "kha", tmp_path / "out", progress=False)
    index = json.loads((tmp_path / "kha" / "model.safetensors.index.json").read_text())["weight_map"]
    untouched = {f for f in set(index.values()) if not any("v_" in k for k, v in index.items() if v == f)}
    assert untouched, "fixture should have shards without v projections"
    for name in untouched:
        assert (tmp_path / "kha" / name).read_bytes() == (result.output / name).read_bytes()


def test_inspect_numbers_match_a_direct_computation(tmp_path, capsys):
    kha = KHAForCausalLM.from_base(tiny_base_model("llama"), knock="mlp_v_linear_qk")
    d = 16
    known = torch.eye(d) + 0.1 * torch.arange(d * d, dtype=torch.float32).reshape(d, d) / (d * d)
    with torch.no_grad():
        kha.model.layers[1].self_attn.q_knock.weight.copy_(known.T)  # T = known
        kha.model.layers[2].self_attn.v_knock.gate.weight.fill_(0.5)
    kha.save_pretrained(tmp_path / "kha")
    rows = {(r["layer"], r["knock"]): r for r in knock_statistics(tmp_path / "kha")}
    assert set(k for _, k in rows) == {"q", "k", "v.up", "v.gate", "v.down"}
    q = rows[(1, "q")]
    assert q["distance"] == pytest.approx(torch.linalg.norm(known - torch.eye(d)).item(), rel=1e-6)
    assert q["mean_diag"] == pytest.approx(known.diagonal().mean().item(), rel=1e-6)
    off = (known * (1 - torch.eye(d))).abs().sum() / known.abs().sum()
    assert q["offdiag_mass"] == pytest.approx(off.item(), rel=1e-6)
    assert rows[(0, "q")]["distance"] == 0 and rows[(0, "q")]["offdiag_mass"] == 0
    gate = rows[(2, "v.gate")]
    assert gate["distance"] == pytest.approx(0.5 * d, rel=1e-6)  # ‖0.5·ones(d,d)‖_F = 0.5·d
    assert gate["mean"] == pytest.approx(0.5) and gate["max_abs"] == pytest.approx(0.5)

    # the heatmaps show T itself, not its transpose (`known` is asymmetric)
    cells = knock_heatmaps(tmp_path / "kha")
    assert torch.allclose(cells[("q", 1)], (known - torch.eye(d)).double())
    assert not torch.allclose(cells[("q", 1)], (known - torch.eye(d)).T.double())

    assert main(["inspect", str(tmp_path / "kha"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data) == 3 * 5
    plot = tmp_path / "knocks.png"
    assert main(["inspect", str(tmp_path / "kha"), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "v.gate" in table and "‖T−T0‖_F" in table
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 5000


def test_a_fold_that_overflows_float16_is_refused_and_writes_nothing(tmp_path, capsys):
    """Both factors fit float16 (knock 6e4 * I, projection entries 2), their product (1.2e5) does not: the cast back
    to the checkpoint's dtype would store infinities, and the folded model would compute NaN."""
    kha = KHAForCausalLM.from_base(tiny_base_model("llama"), knock="linear_qkv")
    attention = kha.model.layers[0].self_attn
    with torch.no_grad():
        attention.q_knock.weight.copy_(6e4 * torch.eye(attention.q_knock.weight.shape[0]))
        attention.q_proj.weight.fill_(2.0)
    kha.to(torch.float16).save_pretrained(tmp_path / "kha")
    assert main(["fold", str(tmp_path / "kha"), str(tmp_path / "out")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "kha fold" in line]  # not the progress bars
    assert len(err) == 1 and err[0].startswith("kha fold: error: "), err
    assert "model.layers.0.self_attn.q_proj.weight" in err[0] and "beyond the range of torch.float16" in err[0], err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*")), list(tmp_path.iterdir())
