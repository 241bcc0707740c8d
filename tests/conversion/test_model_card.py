"""Model cards carry true Hub metadata: base_model is a Hub id or absent, source fields and body are kept."""

import pytest
import yaml

from kha_hf import KHAForCausalLM
from kha_hf.conversion import convert
from kha_hf.modeling.modeling_kha import KNOCKS_FILE
from tests.conversion.test_convert import make_checkpoint
from tests.helpers import tiny_base_model

SOURCE_CARD = """---
license: apache-2.0
language:
- en
datasets:
- HuggingFaceTB/smollm-corpus
base_model: HuggingFaceTB/SmolLM2-135M
pipeline_tag: text-generation
---

# SmolLM2-135M-Instruct

The original card's text, kept below ours.
"""


def front_matter(path) -> dict:
    text = path.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


def test_source_card_metadata_and_body_are_carried(tmp_path):
    src = tmp_path / "SmolLM2-local-copy"
    make_checkpoint(src)
    (src / "README.md").write_text(SOURCE_CARD)
    out = convert(src, tmp_path / "out", progress=False).output
    meta = front_matter(out / "README.md")
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]
    assert meta["datasets"] == ["HuggingFaceTB/smollm-corpus"] and meta["pipeline_tag"] == "text-generation"
    assert {"kha", "knocking-heads-attention", "llama"} <= set(meta["tags"])
    text = (out / "README.md").read_text()
    assert text.index("Knocking-Heads Attention") < text.index("The original card's text, kept below ours.")


def test_a_local_folder_name_is_never_base_model(tmp_path):
    src = tmp_path / "my-llama"
    make_checkpoint(src)
    out = convert(src, tmp_path / "out", progress=False).output
    meta = front_matter(out / "README.md")
    assert "base_model" not in meta and meta["library_name"] == "transformers"


def test_hub_sources_name_their_repo(tmp_path, monkeypatch):
    import kha_hf.conversion.source as source

    src = tmp_path / "cache-snapshot"
    make_checkpoint(src)
    monkeypatch.setattr(source, "download_from_hub", lambda repo, revision=None, token=None: src)
    out = convert("someone/tiny-llama", tmp_path / "out", progress=False).output
    assert front_matter(out / "README.md")["base_model"] == "someone/tiny-llama"


def test_save_pretrained_tags_the_card_and_leaves_no_stale_knocks(tmp_path):
    src = tmp_path / "src"
    make_checkpoint(src, sharded=False)
    out = convert(src, tmp_path / "kha", progress=False).output
    assert (out / KNOCKS_FILE).is_file()
    model = KHAForCausalLM.from_pretrained(out)
    model.save_pretrained(out)  # in place: one model.safetensors now holds the knocks too
    assert not (out / KNOCKS_FILE).exists(), "stale knocks file left next to the new weights"
    assert not (out / "model.safetensors.index.json").exists(), "stale index naming deleted shards"
    reloaded = KHAForCausalLM.from_pretrained(out)
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), reloaded.state_dict().values(), strict=True))
    assert {"kha", "knocking-heads-attention"} <= set(front_matter(out / "README.md")["tags"])

    fresh = tmp_path / "fresh"
    KHAForCausalLM.from_base(tiny_base_model("qwen3")).save_pretrained(fresh)
    meta = front_matter(fresh / "README.md")
    assert {"kha", "knocking-heads-attention", "qwen3"} <= set(meta["tags"]) and "base_model" not in meta
    assert KHAForCausalLM.model_tags == ["kha", "knocking-heads-attention", "kha-hf"]


def test_a_trainers_tags_stay_on_its_model():
    """TRL's trainers call `model.add_model_tags([...])`, which appends in place: on the class's shared list, every
    KHA model made afterwards (any class) carried a reward trainer's tags into its card."""
    from kha_hf import KHAForSequenceClassification

    trained = KHAForCausalLM.from_base(tiny_base_model("qwen3"))
    trained.add_model_tags(["trl", "reward-trainer"])
    assert "reward-trainer" in trained.model_tags
    assert (
        KHAForCausalLM.model_tags
        == KHAForSequenceClassification.model_tags
        == ["kha", "knocking-heads-attention", "kha-hf"]
    )
    assert "reward-trainer" not in KHAForCausalLM.from_base(tiny_base_model("qwen3")).model_tags


@pytest.mark.slow
def test_gguf_metadata_gives_license_and_language_never_a_file_name(tmp_path):
    import json

    from safetensors import safe_open

    from kha_hf.common.assets import smollm2_gguf

    out = convert(smollm2_gguf(), tmp_path / "out", progress=False).output
    meta = front_matter(out / "README.md")
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]
    assert "base_model" not in meta or not str(meta["base_model"]).endswith(".gguf")
    config = json.loads((out / "config.json").read_text())
    assert not any("name_or_path" in key for key in config), "GGUF-derived name in config.json"
    with safe_open(out / KNOCKS_FILE, framework="pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["kha_knock_preset"] == "mlp_v"
        assert f.metadata()["kha_hf_version"]
