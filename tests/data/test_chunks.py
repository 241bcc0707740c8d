"""A prepared corpus's token file is checked chunk by chunk as training reads it (data/chunks.py; #70 item 6): a
`tokens.bin` replaced by other bytes of the same size trained silently before, with a held-out loss reported on data
its manifest does not describe."""

from __future__ import annotations

import hashlib
import json

import pytest

from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.data.chunks import CHUNKS, ChunkHasher
from kha_hf.data.corpus import open_corpus
from kha_hf.data.prepare import tokenize_corpus
from tests.data.test_tokenize import plays_dir, tokenizer_dir  # noqa: F401 (fixtures)


@pytest.fixture
def prepared(plays_dir, tokenizer_dir, tmp_path):  # noqa: F811
    tokenize_corpus([str(plays_dir)], tokenizer_dir, tmp_path / "c", disable_tqdm=True, workers=1)
    return tmp_path / "c"


def test_the_digests_do_not_depend_on_how_the_stream_was_written():
    data = bytes(range(256)) * 1000  # 256,000 bytes in chunks of 10,000
    whole, pieces = ChunkHasher(10_000), ChunkHasher(10_000)
    whole.update(data)
    for at in range(0, len(data), 777):
        pieces.update(data[at : at + 777])
    expected = b"".join(hashlib.sha256(data[at : at + 10_000]).digest() for at in range(0, len(data), 10_000))
    assert whole.finish() == pieces.finish() == expected


def test_a_token_file_replaced_by_bytes_of_the_same_size_is_refused_at_its_first_read(prepared, tmp_path, capsys):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["chunks_sha256"] == hashlib.sha256((prepared / CHUNKS).read_bytes()).hexdigest()
    blocks = open_corpus(prepared).blocks("train", 64)
    blocks.read(0)  # as written: read
    tokens = bytearray((prepared / "tokens.bin").read_bytes())
    tokens[-2:] = tokens[:2]  # the held-out tail, changed in one token: the same size, the same ids' range
    (prepared / "tokens.bin").write_bytes(bytes(tokens))
    heldout = open_corpus(prepared).blocks("heldout", 64)
    with pytest.raises(KHAError, match="is not the token file kha tokenize wrote .* changed since it was prepared"):
        heldout.read(heldout.n - 1)
    # kha train: one line, no model
    out = tmp_path / "run"
    args = ["train", "cpu-tiny", "--data", str(prepared), "--mode", "full", "--max-steps", "1", "--seq-len", "64"]
    assert main([*args, "--batch-size", "2", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the token file kha tokenize wrote" in err[0], err
    assert not out.exists()


def test_a_changed_or_missing_digest_file_is_refused_and_an_older_corpus_reads_unchecked(prepared):
    digests = (prepared / CHUNKS).read_bytes()
    (prepared / CHUNKS).write_bytes(bytes(len(digests)))
    with pytest.raises(KHAError, match="is not the one its manifest records"):
        open_corpus(prepared)
    (prepared / CHUNKS).unlink()
    with pytest.raises(KHAError, match="is missing or not a regular file"):
        open_corpus(prepared)
    manifest = json.loads((prepared / "manifest.json").read_text())
    del manifest["chunk_bytes"], manifest["chunks_sha256"]  # as kha-hf 0.6.1 wrote it
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    corpus = open_corpus(prepared)
    assert corpus.chunks is None and corpus.blocks("train", 64).read(0).shape == (64,)
