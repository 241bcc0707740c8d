"""Round 6's attack on `kha tokenize` and `kha train --resume` (#58's last acceptance line): what got through.

- A hard link to a source file, beside it in the folder, was read twice: the same text trained and was held out.
- A link inside a corpus folder to a file outside it (`passwd.txt -> /etc/passwd`) was tokenized into the corpus.
- A tokenizer whose ids go past the size it states crashed with an OverflowError traceback (uint16).
- `tokens.bin` as a symbolic link to another file of the same size trained on that file.
- A resumed run trusted `trainer_state.json`'s `global_step`: 10^12 "trained" a model in 0 s, -5 ran 11 steps.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kha_hf.common.errors import KHAError
from kha_hf.data.corpus import open_corpus
from kha_hf.data.prepare import tokenize_corpus
from tests.data.test_tokenize import plays_dir, tokenizer_dir  # noqa: F401 (fixtures)


def _refused(sources, tokenizer, out, match: str) -> None:
    with pytest.raises(KHAError, match=match) as refused:
        tokenize_corpus([str(s) for s in sources], tokenizer, out, disable_tqdm=True, workers=1)
    assert "\n" not in str(refused.value)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".partial")]


def test_a_hard_link_to_a_source_is_the_same_file(tokenizer_dir, tmp_path):  # noqa: F811
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("some text " * 200)
    os.link(src / "a.txt", src / "a_again.txt")
    _refused([src], tokenizer_dir, tmp_path / "out", "is named twice among the sources")
    _refused([src / "a.txt", src / "a_again.txt"], tokenizer_dir, tmp_path / "out", "is named twice")


def test_a_link_out_of_a_source_folder_is_refused(tokenizer_dir, tmp_path):  # noqa: F811
    secret = tmp_path / "secret.txt"
    secret.write_text("password hunter2 " * 50)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("some text " * 200)
    (src / "passwd.txt").symlink_to(secret)
    _refused([src], tokenizer_dir, tmp_path / "out", "outside the source folder")
    # a link to a file inside the folder is read (once: its target is not named besides)
    (src / "passwd.txt").unlink()
    (src / "inner").mkdir()
    (src / "a.txt").rename(src / "inner" / "a.txt")
    (src / "link.txt").symlink_to(src / "inner" / "a.txt")
    _refused([src], tokenizer_dir, tmp_path / "out", "is named twice")
    # named on the command line, a file outside any folder is the user's choice
    manifest = tokenize_corpus([str(secret)], tokenizer_dir, tmp_path / "chosen", disable_tqdm=True, workers=1)
    assert manifest["tokens"] > 0


@pytest.mark.parametrize("workers", [1, 2])
def test_a_tokenizer_that_lies_about_its_size_is_one_line(tmp_path, workers):
    """It states 4 tokens (uint16) and gives id 70000 when its vocabulary is read as a list; the id it gives past
    the corpus's dtype is refused in one line, never an OverflowError from a worker."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({"<eos>": 0, "[UNK]": 1, "the": 70000, "quick": 5}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(folder)
    (tmp_path / "a.txt").write_text("the quick " * 100)
    manifest = tokenize_corpus([str(tmp_path / "a.txt")], folder, tmp_path / "out", disable_tqdm=True, workers=workers)
    assert manifest["dtype"] == "uint32"  # sized by the vocabulary's largest id, not the length it states
    assert 70000 in np.fromfile(tmp_path / "out" / "tokens.bin", dtype="<u4")


def test_an_id_past_the_dtype_is_one_line(tokenizer_dir, tmp_path, monkeypatch):  # noqa: F811
    """A tokenizer whose vocabulary and length both say small yet which gives a larger id (its model lies)."""
    from kha_hf.data import prepare

    real = prepare._encode

    def lying(texts, dtype_name):
        original = prepare._worker_tokenizer

        class Liar:
            def __call__(self, texts, **kwargs):
                encoded = original(texts, **kwargs)
                encoded["input_ids"] = [[70000, *row] for row in encoded["input_ids"]]
                return encoded

        prepare._worker_tokenizer = Liar()
        try:
            return real(texts, dtype_name)
        finally:
            prepare._worker_tokenizer = original

    monkeypatch.setattr(prepare, "_encode", lying)
    (tmp_path / "a.txt").write_text("some text " * 200)
    _refused([tmp_path / "a.txt"], tokenizer_dir, tmp_path / "out", "token id 70000, past the uint16")


def test_a_token_file_that_is_a_link_is_refused(plays_dir, tokenizer_dir, tmp_path):  # noqa: F811
    out = tmp_path / "corpus"
    tokenize_corpus([str(plays_dir)], tokenizer_dir, out, disable_tqdm=True, workers=1)
    other = tmp_path / "other.bin"
    other.write_bytes((out / "tokens.bin").read_bytes())
    (out / "tokens.bin").unlink()
    (out / "tokens.bin").symlink_to(other)
    with pytest.raises(KHAError, match="tokens.bin is a symbolic link"):
        open_corpus(out)


@pytest.mark.parametrize("step", [10**12, -5, "4", 3])
def test_a_checkpoint_whose_step_was_changed_is_not_resumed(tmp_path, step):
    from kha_hf.training.train import check_checkpoint_step

    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    with pytest.raises(KHAError, match="is not the step of checkpoint-4"):
        check_checkpoint_step(str(checkpoint), max_steps=6)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    check_checkpoint_step(str(checkpoint), max_steps=6)  # the honest one resumes
    with pytest.raises(KHAError, match="past --max-steps 3"):
        check_checkpoint_step(str(checkpoint), max_steps=3)
