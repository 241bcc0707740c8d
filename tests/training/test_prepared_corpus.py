"""`kha train` and `kha ab` on a prepared corpus: the blocks it reads and the order it reads them in, a model from a
preset or config, and the bad input refused in one line (exit 2) before anything is trained or written."""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kha_hf.data.corpus import open_corpus
from kha_hf.data.order import GlobalBlockOrder
from kha_hf.data.prepare import tokenize_corpus
from kha_hf.training.tokenizer import train_bpe_tokenizer


def kha(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kha_hf", *map(str, args)], capture_output=True, text=True, env=env, timeout=600
    )


def one_line_error(proc: subprocess.CompletedProcess, command: str, text: str) -> None:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kha {command}: error:") and text in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_the_trainer_reads_the_global_order(prepared):
    """KHATrainer's data loader over a prepared corpus draws blocks in GlobalBlockOrder(seed), not RandomSampler's."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from kha_hf import KHAForCausalLM
    from kha_hf.training.train import paper_training_arguments
    from kha_hf.training.trainer import KHATrainer

    blocks = open_corpus(prepared).blocks("train", 64)
    config = Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = KHAForCausalLM.from_base(AutoModelForCausalLM.from_config(config))
    args = paper_training_arguments("unused", per_device_train_batch_size=4, seed=5, data_seed=5, max_steps=1)
    loader = KHATrainer(model=model, args=args, train_dataset=blocks).get_train_dataloader()
    first = next(iter(loader))["input_ids"]
    expected = list(GlobalBlockOrder(len(blocks), 5))[:4]
    assert torch.equal(first, torch.stack([blocks[i]["input_ids"] for i in expected]))


def test_from_a_preset_the_knocks_start_at_the_identity_and_the_model_saves(prepared, tmp_path):
    proc = kha("train", "cpu-tiny", "--knock", "linear_qkv", "--mode", "full", "--data", prepared, "--max-steps", "2",
               "--seq-len", "32", "--batch-size", "2", "--output", tmp_path / "run")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "knocks at the start: identity on all 1 ranks; weight decay on knocks: [0.0]" in proc.stdout
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["knock_q"], config["knock_k"], config["knock_v"]) == ("linear", "linear", "linear")
    assert config["vocab_size"] == 512  # the corpus's tokenizer
    assert (tmp_path / "run" / "tokenizer.json").is_file()


def test_from_a_config_file(prepared, tmp_path):
    from kha_hf.training.presets import PRESETS

    config = PRESETS["cpu-tiny"].config().to_dict()
    config.update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)
    config.pop("layer_types", None)  # the preset's lists 4 layers
    (tmp_path / "my.json").write_text(json.dumps(config))
    proc = kha("train", tmp_path / "my.json", "--mode", "full", "--data", prepared, "--max-steps", "1", "--seq-len",
               "32", "--batch-size", "2", "--output", tmp_path / "run")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 1 and saved["knock_v"] == "mlp"


def test_kha_ab_reads_a_prepared_corpus(prepared, tmp_path):
    proc = kha("ab", "cpu-tiny", "--data", prepared, "--max-steps", "2", "--seq-len", "32", "--batch-size", "2",
               "--seeds", "1", "--output", tmp_path / "ab")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "ab" / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["per_seed"]) == 1


@pytest.fixture(scope="module")
def other_corpus(corpus, tmp_path_factory):
    """The same text prepared with another tokenizer (same size, another vocabulary)."""
    data, _ = corpus
    root = tmp_path_factory.mktemp("other")
    train_bpe_tokenizer([p.read_text()[::-1] for p in sorted(data.glob("*.md"))], 512).save_pretrained(root / "tok")
    tokenize_corpus([str(data)], root / "tok", root / "corpus", workers=1, disable_tqdm=True)
    return root / "corpus"


def test_another_tokenizer_is_refused(kha_dir, other_corpus, tmp_path):
    proc = kha("train", kha_dir, "--data", other_corpus, "--max-steps", "1", "--output", tmp_path / "run")
    one_line_error(proc, "train", "was prepared with another tokenizer than the model's tokenizer")
    assert not (tmp_path / "run").exists()


def test_a_changed_source_is_refused(corpus, tmp_path):
    data, tokenizer = corpus
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.md").write_text(next(data.glob("*.md")).read_text())
    tokenizer.save_pretrained(tmp_path / "tok")
    tokenize_corpus([str(src)], tmp_path / "tok", tmp_path / "c", workers=1, disable_tqdm=True)
    (src / "a.md").write_text("changed")
    proc = kha("train", "cpu-tiny", "--mode", "full", "--data", tmp_path / "c", "--output", tmp_path / "run")
    one_line_error(proc, "train", "changed since")


def test_seq_len_past_the_positions_is_refused(kha_dir, prepared, tmp_path):
    positions = json.loads((kha_dir / "config.json").read_text())["max_position_embeddings"]
    proc = kha("train", kha_dir, "--data", prepared, "--seq-len", positions + 1, "--output", tmp_path / "run")
    one_line_error(proc, "train", f"past the model's {positions} positions")


def test_ids_past_the_vocabulary_are_refused(kha_dir, prepared, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(prepared, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["max_token_id"] = 600
    (bad / "manifest.json").write_text(json.dumps(manifest))
    proc = kha("train", kha_dir, "--data", bad, "--output", tmp_path / "run")
    one_line_error(proc, "train", "past the model's vocabulary of 512")


def test_config_errors_are_one_line(prepared, tmp_path):
    one_line_error(kha("train", "cpu-tiny", "--data", prepared, "--output", tmp_path / "r"), "train", "--mode full")
    (tmp_path / "huge.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 10**9}))
    proc = kha("train", tmp_path / "huge.json", "--mode", "full", "--data", prepared, "--output", tmp_path / "r")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    one_line_error(kha("train", "gpu-small", "--mode", "full", "--output", tmp_path / "r"), "train", "--tokenizer")


def test_raw_text_that_would_not_fit_names_kha_tokenize(corpus, monkeypatch):
    from kha_hf.common.errors import KHAError
    from kha_hf.training import corpus_data

    data, _ = corpus
    monkeypatch.setattr(corpus_data, "available_memory", lambda: 1 << 20)  # 1 MiB free
    with pytest.raises(KHAError, match="prepare it once with kha tokenize"):
        corpus_data.check_raw_data_fits([str(data)])
    monkeypatch.setattr(corpus_data, "available_memory", lambda: 1 << 40)
    corpus_data.check_raw_data_fits([str(data)])


def test_a_hub_dataset_is_streamed(corpus, tmp_path, monkeypatch):
    """A Hub dataset is read with streaming=True, row by row (no network here: datasets' loader is replaced)."""
    import datasets

    data, tokenizer = corpus
    tokenizer.save_pretrained(tmp_path / "tok")
    calls = []

    def fake_load_dataset(name, split=None, streaming=False, **kwargs):
        calls.append((name, split, streaming))
        return iter([{"text": "first row of text " * 50}, {"text": ""}, {"other": 1}, {"text": "second " * 100}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    manifest = tokenize_corpus(["someone/corpus"], tmp_path / "tok", tmp_path / "c", workers=1, disable_tqdm=True)
    assert calls == [("someone/corpus", "train", True)]
    assert manifest["documents"] == 2 and manifest["skipped"]["empty"] == 1 and manifest["skipped"]["no_text"] == 1
    assert manifest["sources"][0]["kind"] == "hub"
    ids = np.fromfile(tmp_path / "c" / "tokens.bin", dtype=np.uint16)
    assert (ids == tokenizer.eos_token_id).sum() == 2


def test_a_tokenizer_without_a_pad_token_trains(corpus, tmp_path):
    """Blocks are all seq_len long: nothing is padded, so a tokenizer without a pad token trains (the padding
    collator refused it with a traceback)."""
    data, tokenizer = corpus
    tok = copy.deepcopy(tokenizer)
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "tok")
    tokenize_corpus([str(data)], tmp_path / "tok", tmp_path / "c", workers=1, disable_tqdm=True)
    proc = kha("train", "cpu-tiny", "--mode", "full", "--data", tmp_path / "c", "--max-steps", "1", "--seq-len", "32",
               "--batch-size", "2", "--output", tmp_path / "run")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_too_large_a_config_and_a_preset_shadowed_by_a_folder_are_refused(prepared, tmp_path):
    from kha_hf.training.presets import PRESETS

    config = PRESETS["cpu-tiny"].config().to_dict()
    config.update(hidden_size=8192, intermediate_size=200_000, num_attention_heads=64, head_dim=128)
    (tmp_path / "big.json").write_text(json.dumps(config))
    proc = kha("train", tmp_path / "big.json", "--mode", "full", "--data", prepared, "--output", tmp_path / "r")
    one_line_error(proc, "train", "GiB of weights, more than the")
    (tmp_path / "cpu-tiny").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "kha_hf", "train", "cpu-tiny", "--mode", "full", "--data", str(prepared), "--output",
         str(tmp_path / "r")], capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    one_line_error(proc, "train", "is a preset and also a path here")


def test_a_run_record_that_is_not_a_file_is_refused_on_resume(prepared, tmp_path):
    out = tmp_path / "run"
    base = ["train", "cpu-tiny", "--mode", "full", "--data", prepared, "--max-steps", "2", "--save-steps", "1",
            "--seq-len", "32", "--batch-size", "2", "--output", out]  # fmt: skip
    assert kha(*base).returncode == 0
    (out / "kha_data.json").unlink()
    (out / "kha_data.json").symlink_to("/dev/zero")
    # refused with every link in the run's folder, before the record is read (training/resume_files.py)
    one_line_error(kha(*base, "--resume"), "train", "kha_data.json is a symbolic link")
    (out / "kha_data.json").unlink()
    os.mkfifo(out / "kha_data.json")
    one_line_error(kha(*base, "--resume"), "train", "kha_data.json is not a regular file")
