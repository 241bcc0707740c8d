"""A prepared corpus's tokenizer check sees what decides the encoding (#70 item 5): a tokenizer with the same
vocabulary, special tokens and probe encoding but another normalizer or fewer merges is another tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from kha_hf.data.fingerprint import PROBE, fingerprint_difference, tokenizer_fingerprint
from kha_hf.training.data import read_documents
from kha_hf.training.tokenizer import train_bpe_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(read_documents(None)[:1], 512)


def edited(tokenizer, edit, folder):
    """TOKENIZER saved to FOLDER with its tokenizer.json changed by EDIT(definition), loaded back as a user would."""
    tokenizer.save_pretrained(folder)
    definition = json.loads((folder / "tokenizer.json").read_text())
    edit(definition)
    (folder / "tokenizer.json").write_text(json.dumps(definition))
    return AutoTokenizer.from_pretrained(folder)


def q_to_k(definition):
    definition["normalizer"] = {"type": "Replace", "pattern": {"String": "q"}, "content": "k"}


def without_th_merges(definition):
    merges = definition["model"]["merges"]
    kept = [m for m in merges if "th" not in (m if isinstance(m, str) else "".join(m))]
    assert len(kept) < len(merges), "the tokenizer has no merge with 'th' to drop"
    definition["model"]["merges"] = kept


@pytest.mark.parametrize("edit", [q_to_k, without_th_merges])
def test_another_normalizer_or_fewer_merges_is_another_tokenizer(tokenizer, edit, tmp_path):
    other = edited(tokenizer, edit, tmp_path / "other")
    recorded, actual = tokenizer_fingerprint(tokenizer), tokenizer_fingerprint(other)
    # what the fingerprint held before: the same vocabulary and the same ids for the probe (it has no q, no "th")
    assert "q" not in PROBE.lower() and "th" not in PROBE.lower()
    assert recorded["vocab_sha256"] == actual["vocab_sha256"] and recorded["probe_sha256"] == actual["probe_sha256"]
    assert fingerprint_difference(recorded, actual) == "another normalizer, pre-tokenizer, merges or post-processor"


def test_the_same_tokenizer_reloaded_agrees_and_an_older_manifest_is_compared_on_the_rest(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert fingerprint_difference(tokenizer_fingerprint(tokenizer), tokenizer_fingerprint(reloaded)) is None
    older = {k: v for k, v in tokenizer_fingerprint(tokenizer).items() if k != "encoding_sha256"}
    assert fingerprint_difference(older, tokenizer_fingerprint(edited(tokenizer, q_to_k, tmp_path / "q"))) is None
