"""A multimodal KHA model (tiny Gemma 3 with its processor) in vLLM's Transformers backend, with an image prompt.

Two routes, as for text models: with kha-hf's vLLM plugin, `LLM(model=DIR)` and nothing else (the folder's code
poisoned, so none of it runs), and without it, `model_impl="transformers", trust_remote_code=True`.

The reference is the stock model in the same backend (vLLM 0.32), not transformers' `generate`: for an image prompt
the two disagree on the stock model itself. transformers' Gemma 3 lets the tokens of one image attend to each other
both ways (`create_masks_for_vision_model`), vLLM's Transformers backend runs every token causally. For text prompts
vLLM and transformers agree, and the test checks that too. So, token for token:
- identity knocks (a fresh conversion) = the stock model, with and without an image;
- perturbed linear knocks (folded into the projections by the plugin as the weights load) = the checkpoint that
  `kha fold` makes of them, loaded as a stock Gemma 3;
- perturbed MLP value knocks (down map folded into o_proj by the plugin) = the same checkpoint through remote code,
  whose knocks run as transformers modules;
- the perturbed knocks change the tokens (else nothing is shown);
- a hostile checkpoint with an unfolded fused projection beside the folded ones is refused.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from kha_hf.cli import main
from tests.helpers import randomize_knocks
from tests.multimodal_helpers import save_gemma3_with_processor
from tests.vllm.conftest import WITHOUT_PLUGIN, run_worker, with_plugin
from tests.vllm.test_vllm_backend import PERTURBATION
from tests.vllm.test_vllm_plugin import poison_folder_code

pytestmark = pytest.mark.slow

NEW_TOKENS = 6
# the image goes where the prompt names it (Gemma 3's processor expands <start_of_image> to the image's tokens)
PROMPTS = [{"text": "the fox <start_of_image> jumps", "image": 0}, {"text": "the quick fox jumps", "image": None}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> folder: the stock model ("stock"), its identity conversion, perturbed MLP value and linear knocks
    (plugin copies poisoned; "mlp_v-remote" an unpoisoned copy), the fold of the linear ones and a hostile copy of
    them ("fused-alias"); plus transformers' greedy tokens of the text prompt for each ("expected")."""
    root = tmp_path_factory.mktemp("vllm-multimodal")
    save_gemma3_with_processor(root / "stock", head_dim=32, vocab_size=300)  # vLLM's CPU kernels: head_dim >= 32
    out = {"stock": root / "stock"}
    for preset in ("mlp_v", "linear_qkv"):
        identity = root / f"{preset}-identity"
        assert main(["convert", str(root / "stock"), str(identity), "--knock", preset]) == 0
        model = AutoModelForImageTextToText.from_pretrained(identity)
        randomize_knocks(model, scale=PERTURBATION[preset])
        model.save_pretrained(root / preset)
        AutoProcessor.from_pretrained(identity).save_pretrained(root / preset)
        out[preset] = root / preset
    out["identity"] = root / "mlp_v-identity"
    assert main(["fold", str(root / "linear_qkv"), str(root / "linear_qkv-folded")]) == 0
    out["folded"] = root / "linear_qkv-folded"
    shutil.copytree(root / "mlp_v", root / "mlp_v-remote")
    out["mlp_v-remote"] = root / "mlp_v-remote"
    # a hostile copy: an unfolded fused qkv_proj beside the separate projections, which vLLM would load over the fold
    shutil.copytree(root / "linear_qkv", root / "fused-alias")
    weights = load_file(root / "fused-alias" / "model.safetensors")
    prefix = "language_model.model.layers.0.self_attn."
    weights[f"{prefix}qkv_proj.weight"] = torch.cat([weights[f"{prefix}{p}_proj.weight"] for p in "qkv"])
    save_file(weights, root / "fused-alias" / "model.safetensors", metadata={"format": "pt"})
    out["fused-alias"] = root / "fused-alias"
    processor = AutoProcessor.from_pretrained(root / "stock")
    text = processor(text=PROMPTS[1]["text"], return_tensors="pt")
    expected = {}
    for name in ("stock", "mlp_v", "linear_qkv"):
        model = AutoModelForImageTextToText.from_pretrained(out[name]).eval()
        with torch.no_grad():
            ids = model.generate(**text, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        expected[name] = ids[0, text["input_ids"].shape[1] :].tolist()
    for name in ("identity", "mlp_v", "linear_qkv", "fused-alias"):
        assert poison_folder_code(out[name]), f"{name}: the KHA checkpoint carries no remote code to poison"
    return out, expected


def _job(folders, models) -> dict:
    return {
        "mode": "multimodal",
        "max_tokens": NEW_TOKENS,
        "max_model_len": 128,
        "prompts": PROMPTS,
        "models": [{"path": str(folders[name]), **spec} for name, spec in models.items()],
    }


@pytest.fixture(scope="module")
def runs(folders, vllm_env, vllm_plugin, tmp_path_factory):
    """name -> vLLM's tokens for PROMPTS, and the logs of the two vLLM processes (with and without the plugin)."""
    paths, _ = folders
    stock = {"impl": "transformers"}
    plugin = {"impl": None, "trust_remote_code": False}
    with_it = run_worker(
        vllm_env,
        _job(
            paths,
            {
                **{name: stock for name in ("stock", "folded")},
                **{name: plugin for name in ("identity", "mlp_v", "linear_qkv", "fused-alias")},
            },
        ),
        tmp_path_factory.mktemp("job-plugin"),
        env=with_plugin(),
    )
    without = run_worker(
        vllm_env,
        _job(paths, {"mlp_v-remote": {"impl": "transformers", "trust_remote_code": True}}),
        tmp_path_factory.mktemp("job-remote"),
        env={"VLLM_PLUGINS": WITHOUT_PLUGIN},
    )
    tokens = {}
    for name, path in paths.items():
        got = with_it.get(str(path)) or without.get(str(path))
        if got is not None and name != "fused-alias":
            assert "error" not in got, f"vLLM could not run {name}: {got['error']}"
            tokens[name] = got["tokens"]
    tokens["fused-alias"] = with_it[str(paths["fused-alias"])]
    return tokens, with_it["_log"], without["_log"]


def test_identity_knocks_give_the_stock_models_tokens(runs):
    tokens, _, _ = runs
    assert tokens["identity"] == tokens["stock"], f"KHA {tokens['identity']} != stock {tokens['stock']}"


def test_the_stock_model_in_vllm_matches_transformers_on_text(folders, runs):
    _, expected = folders
    tokens, _, _ = runs
    assert tokens["stock"][1] == expected["stock"]


def test_plugin_linear_knocks_equal_their_fold(folders, runs):
    _, expected = folders
    tokens, log, _ = runs
    assert tokens["linear_qkv"] == tokens["folded"], f"KHA {tokens['linear_qkv']} != folded {tokens['folded']}"
    assert tokens["linear_qkv"][1] == expected["linear_qkv"], "the text prompt's tokens differ from transformers'"
    assert tokens["linear_qkv"][0] != tokens["stock"][0], "the knocks do not change the image prompt's tokens"
    line = "(gemma3 with a gemma3_text base; knocks q linear, k linear, v linear; linear knocks folded into the "
    assert "kha-hf plugin: KHAForConditionalGeneration " + line in log


def test_plugin_mlp_knocks_equal_remote_code(folders, runs):
    _, expected = folders
    tokens, log, _ = runs
    assert tokens["mlp_v"] == tokens["mlp_v-remote"], f"plugin {tokens['mlp_v']} != remote {tokens['mlp_v-remote']}"
    assert tokens["mlp_v"][1] == expected["mlp_v"], "the text prompt's tokens differ from transformers'"
    assert tokens["mlp_v"][0] != tokens["stock"][0], "the knocks do not change the image prompt's tokens"
    layers = 3  # every text layer: its MLP value knock's down map went into o_proj
    assert log.count(f"kha-hf plugin: {layers} MLP value knocks run as up+gate matmul and glu") == 2  # mlp_v, identity
    assert "checkpoint folder's code was executed" not in log


def test_without_the_plugin_remote_code_takes_the_multimodal_backend(runs):
    _, _, log = runs
    assert "Resolved architecture: TransformersMultiModalForCausalLM" in log, log[-3000:]
    assert "kha-hf plugin" not in log


def test_plugin_refuses_an_unfolded_fused_projection_beside_the_folded_ones(runs):
    """Found by the attack on this route: vLLM maps both the separate q/k/v projections and a fused `qkv_proj` onto
    its one fused parameter, so the unfolded copy would overwrite the fold and the model would serve the stock
    model's tokens without a word."""
    tokens, _, _ = runs
    assert "error" in tokens["fused-alias"], f"served {tokens['fused-alias']}"
    line = (
        "KHA checkpoint refused: language_model.model.layers.0.self_attn.qkv_proj.weight loads into "
        "model.language_model.layers.0.self_attn.qkv_proj.weight, as the folded "
        "language_model.model.layers.0.self_attn.k_proj.weight does: the checkpoint holds that projection twice"
    )  # k_proj: the first projection in the file's (sorted) order
    assert line in tokens["fused-alias"]["error"], tokens["fused-alias"]["error"]  # what LLM(...) raised
