"""Shared by the training tests: a short corpus, its tokenizer, and a briefly pretrained tiny KHA model."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kha_hf import KHAForCausalLM
from kha_hf.training.data import read_documents
from kha_hf.training.tokenizer import train_bpe_tokenizer
from kha_hf.training.train import train

STEPS = dict(seq_len=64, batch_size=4, disable_tqdm=True, logging_steps=2)


def tiny_qwen3(vocab_size: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two plays of the embedded corpus, cut short, as .md files, and a tokenizer trained on them."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = read_documents(None)[:2]
    for i, doc in enumerate(docs):
        (folder / f"play{i}.md").write_text(doc[:60000])
    return folder, train_bpe_tokenizer(docs, 512)


@pytest.fixture(scope="module")
def kha_dir(corpus, tmp_path_factory):
    """A tiny Qwen3 KHA model, briefly pretrained (full mode) so that knock training has signal to follow."""
    data, tokenizer = corpus
    root = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    config = tiny_qwen3(vocab_size=512)
    kha = KHAForCausalLM.from_base(Qwen3ForCausalLM(config), knock="mlp_v_linear_qk")
    kha.save_pretrained(root / "init")
    tokenizer.save_pretrained(root / "init")
    train(root / "init", root / "warm", data=[str(data)], mode="full", max_steps=12, lr=3e-3, **STEPS)
    return root / "warm"


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """The two plays prepared by kha tokenize with the corpus fixture's tokenizer (kha_dir's own)."""
    from kha_hf.data.prepare import tokenize_corpus

    data, tokenizer = corpus
    root = tmp_path_factory.mktemp("prepared")
    tokenizer.save_pretrained(root / "tokenizer")
    tokenize_corpus([str(data)], root / "tokenizer", root / "corpus", workers=1, disable_tqdm=True)
    return root / "corpus"
