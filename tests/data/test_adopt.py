"""`kha tokenize FILE... --from-tokens FORMAT` (kha_hf/data/adopt.py): token files another tool wrote become a
prepared corpus without tokenizing again. The corpus holds exactly the source's ids (hard-linked where its bytes
already are a corpus's, copied with --copy), cuts the blocks `kha tokenize` cuts for the same stream, trains, and
every refusal is one line that leaves no output, no temporary folder and the source as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.data.adopt import READ_BYTES, adopt_tokens
from kha_hf.data.corpus import SPLITS, open_corpus
from kha_hf.data.megatron_index import SLICE
from kha_hf.data.prepare import tokenize_corpus
from tests.data.test_tokenize import plays_dir, tokenizer_dir  # noqa: F401 (fixtures)

EOS, VOCAB = 0, 512  # the test tokenizer's EOS id and size (tests/data/test_tokenize.py)
MEGATRON_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}


def stream(n: int, seed: int = 0, every: int = 37) -> np.ndarray:
    """N ids of documents separated by EOS (about one in EVERY), ending with EOS; int64."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, n)
    ids[rng.random(n) < 1 / every] = EOS
    ids[-1] = EOS
    return ids


def write_megatron(prefix: Path, tokens, lengths, doc_index, dtype: str, modes: bool = False) -> None:
    """PREFIX.bin and PREFIX.idx byte for byte as megatron-core's IndexedDatasetBuilder.finalize writes them
    (megatron/core/datasets/indexed_dataset.py, `_IndexWriter`)."""
    np.asarray(tokens).astype(dtype).tofile(f"{prefix}.bin")
    lengths = np.asarray(lengths, np.int64)
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1]))) * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index)))
        f.write(lengths.astype("<i4").tobytes() + pointers.astype("<i8").tobytes())
        f.write(np.asarray(doc_index, "<i8").tobytes())
        if modes:  # a multimodal dataset's int8 sequence modes
            f.write(np.zeros(len(lengths), np.int8).tobytes())


def megatron_docs(prefix: Path, docs: list, dtype: str = "uint16", modes: bool = False) -> np.ndarray:
    """DOCS (id lists) as a Megatron dataset, each document in two sequences (sentences); returns the stream."""
    lengths, doc_index = [], [0]
    for doc in docs:
        lengths += [len(doc) // 2, len(doc) - len(doc) // 2]
        doc_index.append(len(lengths))
    tokens = np.concatenate([np.asarray(d, np.int64) for d in docs])
    write_megatron(prefix, tokens, lengths, doc_index, dtype, modes)
    return tokens


def documents(n_docs: int, seed: int = 1, eos_every: int | None = 1) -> list[np.ndarray]:
    """N_DOCS documents of 5..200 ids; every EOS_EVERY-th ends with EOS (None: none does)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, VOCAB, rng.integers(5, 200)) for _ in range(n_docs)]
    for i, doc in enumerate(docs):
        if eos_every and i % eos_every == 0:
            doc[-1] = EOS
    return docs


def tokens_of(folder: Path) -> np.ndarray:
    manifest = json.loads((folder / "manifest.json").read_text())
    return np.fromfile(folder / "tokens.bin", dtype=manifest["dtype"]).astype(np.int64)


def adopt(sources, tokenizer, out, fmt, **kwargs) -> dict:
    return adopt_tokens([str(s) for s in sources], tokenizer, out, fmt, disable_tqdm=True, **kwargs)


def fingerprint(paths) -> list:
    """What must not change in a source: its bytes, size, time and links."""
    out = []
    for path in paths:
        info = os.stat(path)
        out.append((hashlib.sha256(Path(path).read_bytes()).hexdigest(), info.st_size, info.st_mtime_ns, info.st_nlink))
    return out


# ---- what is adopted ------------------------------------------------------------------------------------------------


def test_a_nanogpt_file_is_hard_linked_and_cuts_the_blocks_kha_tokenize_cuts(plays_dir, tokenizer_dir, tmp_path):  # noqa: F811
    """The stream `kha tokenize` writes, given as a nanoGPT train.bin: the adopted corpus is a hard link to it, with
    the same manifest fields (tokens, digests, documents, splits, tokenizer) and the same blocks in every split."""
    tokenized = tmp_path / "tokenized"
    expected = tokenize_corpus([str(plays_dir)], tokenizer_dir, tokenized, workers=1, disable_tqdm=True)
    (tmp_path / "src").mkdir()
    source = tmp_path / "src" / "train.bin"
    shutil.copyfile(tokenized / "tokens.bin", source)
    manifest = adopt([source], tokenizer_dir, tmp_path / "c", "nanogpt")
    assert os.stat(tmp_path / "c" / "tokens.bin").st_ino == os.stat(source).st_ino  # a hard link, no copy
    assert os.stat(source).st_nlink == 2
    same = ("dtype", "tokens", "tokens_sha256", "chunk_bytes", "chunks_sha256", "max_token_id", "documents", "splits")
    assert {k: manifest[k] for k in same} == {k: expected[k] for k in same}
    assert manifest["tokenizer"] == {**expected["tokenizer"], "name": str(tokenizer_dir)}
    assert manifest["adopted"] == {"format": "nanogpt", "linked": True, "source_dtypes": ["uint16"], "eos_inserted": 0}
    data = source.read_bytes()
    assert manifest["sources"] == [
        {
            "name": str(source),
            "kind": "file",
            "bytes": len(data),
            "documents": expected["documents"],
            "sha256": hashlib.sha256(data).hexdigest(),
            "mtime_ns": os.stat(source).st_mtime_ns,
            "skipped": {},
        }
    ]
    assert json.loads((tmp_path / "c" / "manifest.json").read_text()) == manifest
    assert (tmp_path / "c" / "tokenizer" / "tokenizer.json").is_file()
    adopted, reference = open_corpus(tmp_path / "c"), open_corpus(tokenized)
    adopted.check_sources_unchanged()
    for split in SPLITS:
        ours, theirs = adopted.blocks(split, 16), reference.blocks(split, 16)
        assert len(ours) == len(theirs) > 0
        assert all(torch.equal(ours.read(i), theirs.read(i)) for i in range(len(ours)))
    ids = np.frombuffer(data, np.uint16)
    assert adopted.blocks("train", 16).read(0).tolist() == ids[:16].tolist()
    shutil.rmtree(tmp_path / "c")  # removing the corpus removes the link, never the source
    assert source.read_bytes() == data and os.stat(source).st_nlink == 1


def test_copy_writes_a_new_file_of_the_same_ids(tokenizer_dir, tmp_path):  # noqa: F811
    ids = stream(50_000)
    source = tmp_path / "train.bin"
    ids.astype(np.uint16).tofile(source)
    manifest = adopt([source], tokenizer_dir, tmp_path / "c", "nanogpt", copy=True)
    info = os.stat(tmp_path / "c" / "tokens.bin")
    assert info.st_ino != os.stat(source).st_ino and info.st_nlink == 1 and os.stat(source).st_nlink == 1
    assert tokens_of(tmp_path / "c").tolist() == ids.tolist()
    assert manifest["adopted"]["linked"] is False and manifest["documents"] == int(np.count_nonzero(ids == EOS))
    assert manifest["sources"][0]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()


def test_megatron_documents_ending_with_eos_are_linked_in_every_naming(tokenizer_dir, tmp_path):  # noqa: F811
    docs = documents(300)
    tokens = megatron_docs(tmp_path / "ds_text_document", docs, "uint16", modes=True)
    for i, name in enumerate(["ds_text_document", "ds_text_document.bin", "ds_text_document.idx"]):
        out = tmp_path / f"c{i}"
        manifest = adopt([tmp_path / name], tokenizer_dir, out, "megatron")
        assert os.stat(out / "tokens.bin").st_ino == os.stat(tmp_path / "ds_text_document.bin").st_ino
        assert tokens_of(out).tolist() == tokens.tolist()
        assert manifest["documents"] == 300 and manifest["adopted"]["eos_inserted"] == 0
        assert [s["name"] for s in manifest["sources"]] == [
            str(tmp_path / "ds_text_document.bin"),
            str(tmp_path / "ds_text_document.idx"),
        ]
        idx = (tmp_path / "ds_text_document.idx").read_bytes()
        assert manifest["sources"][1]["sha256"] == hashlib.sha256(idx).hexdigest()
        open_corpus(out).check_sources_unchanged()


def test_megatron_int32_is_linked_as_uint32_and_int64_needs_copy(tokenizer_dir, tmp_path):  # noqa: F811
    docs = documents(100)
    tokens = megatron_docs(tmp_path / "a", docs, "int32")
    manifest = adopt([tmp_path / "a"], tokenizer_dir, tmp_path / "c", "megatron")
    assert manifest["dtype"] == "uint32" and manifest["adopted"]["linked"]
    assert tokens_of(tmp_path / "c").tolist() == tokens.tolist()
    megatron_docs(tmp_path / "b", docs, "int64")
    with pytest.raises(KHAError, match="holds int64 ids, which a corpus stores as uint16: .* pass --copy"):
        adopt([tmp_path / "b"], tokenizer_dir, tmp_path / "d", "megatron")
    manifest = adopt([tmp_path / "b"], tokenizer_dir, tmp_path / "d", "megatron", copy=True)
    assert manifest["dtype"] == "uint16" and tokens_of(tmp_path / "d").tolist() == tokens.tolist()


def test_megatron_documents_without_eos_get_one_with_copy(tokenizer_dir, tmp_path):  # noqa: F811
    """Every third document ends with EOS; with --copy each other one gets an EOS after it, nothing else changes."""
    docs = documents(200, eos_every=3)
    megatron_docs(tmp_path / "ds", docs, "uint16")
    manifest = adopt([tmp_path / "ds"], tokenizer_dir, tmp_path / "c", "megatron", copy=True)
    expected = [t for doc in docs for t in (list(doc) if doc[-1] == EOS else [*doc, EOS])]
    assert tokens_of(tmp_path / "c").tolist() == expected
    assert manifest["adopted"]["eos_inserted"] == sum(doc[-1] != EOS for doc in docs) == 133
    assert manifest["documents"] == 200 and manifest["tokens"] == len(expected)


def test_a_large_megatron_dataset_streams_across_reads_and_index_slices(tokenizer_dir, tmp_path):  # noqa: F811
    """More ids than one read (READ_BYTES) and more sequences than one index slice (SLICE), a document ending exactly
    at the first read's end, empty documents: the same tokens as the whole stream with EOS inserted."""
    rng = np.random.default_rng(3)
    n_seq = SLICE + 200_000
    lengths = rng.integers(1, 8, n_seq)
    per_read = READ_BYTES // 2
    cut = int(np.searchsorted(np.cumsum(lengths), per_read))  # sequences 0..cut end at or past the first read
    lengths[cut] -= int(np.cumsum(lengths)[cut] - per_read)  # ... and now exactly at its end
    assert lengths[cut] >= 0
    starts = np.unique(np.concatenate(([0, cut + 1], rng.choice(np.arange(1, n_seq), n_seq // 3, replace=False))))
    doc_index = np.sort(np.concatenate((starts, [n_seq], starts[5:9])))  # four empty documents (a repeated start)
    tokens = rng.integers(1, VOCAB, int(lengths.sum()))
    ends = np.cumsum(lengths)[np.unique(doc_index[1:]) - 1]
    ends = np.unique(ends[ends > 0])
    tokens[ends[::2] - 1] = EOS  # every other document ends with EOS
    write_megatron(tmp_path / "big", tokens, lengths, doc_index, "uint16")
    assert tokens.size * 2 > READ_BYTES and per_read in ends
    manifest = adopt([tmp_path / "big"], tokenizer_dir, tmp_path / "c", "megatron", copy=True)
    missing = ends[tokens[ends - 1] != EOS]
    assert np.array_equal(tokens_of(tmp_path / "c"), np.insert(tokens, missing, EOS))
    assert manifest["documents"] == ends.size and manifest["adopted"]["eos_inserted"] == missing.size


def test_numpy_files_raw_and_with_a_header(tokenizer_dir, tmp_path):  # noqa: F811
    """A raw uint32 memmap (OLMo-core) is linked as a uint32 corpus; .npy files with a header are joined with --copy,
    an EOS after a file whose stream does not end with one."""
    ids = stream(40_000, seed=4)
    ids.astype(np.uint32).tofile(tmp_path / "part-0.npy")
    manifest = adopt([tmp_path / "part-0.npy"], tokenizer_dir, tmp_path / "raw", "numpy", dtype="uint32")
    assert manifest["dtype"] == "uint32" and manifest["adopted"]["linked"]
    assert os.stat(tmp_path / "raw" / "tokens.bin").st_ino == os.stat(tmp_path / "part-0.npy").st_ino
    assert tokens_of(tmp_path / "raw").tolist() == ids.tolist()
    first, second = stream(30_000, seed=5)[:-1], stream(20_000, seed=6)  # the first does not end with EOS
    np.save(tmp_path / "a.npy", first.astype(np.uint16))
    np.save(tmp_path / "b.npy", second.astype(np.int32))
    sources = [tmp_path / "a.npy", tmp_path / "b.npy"]
    manifest = adopt(sources, tokenizer_dir, tmp_path / "joined", "numpy", copy=True)
    assert tokens_of(tmp_path / "joined").tolist() == [*first.tolist(), EOS, *second.tolist()]
    assert manifest["dtype"] == "uint16" and manifest["adopted"]["eos_inserted"] == 1
    assert manifest["adopted"]["source_dtypes"] == ["int32", "uint16"]
    assert [s["sha256"] for s in manifest["sources"]] == [hashlib.sha256(p.read_bytes()).hexdigest() for p in sources]
    eos = [int(np.count_nonzero(first == EOS)) + 1, int(np.count_nonzero(second == EOS))]
    assert [s["documents"] for s in manifest["sources"]] == eos and manifest["documents"] == sum(eos)


@pytest.mark.slow  # a training run (tests/conftest.py's policy), about 20 s on 2 CPU cores
def test_kha_train_trains_on_an_adopted_corpus(tokenizer_dir, tmp_path):  # noqa: F811
    from kha_hf.training.train import train

    source = tmp_path / "train.bin"
    stream(60_000, seed=7).astype(np.uint16).tofile(source)
    before = fingerprint([source])
    adopt([source], tokenizer_dir, tmp_path / "c", "nanogpt")
    result = train(
        "cpu-tiny", tmp_path / "run", data=[str(tmp_path / "c")], mode="full", max_steps=2, seq_len=32,
        batch_size=2, max_eval_blocks=2, disable_tqdm=True,
    )  # fmt: skip
    assert (tmp_path / "run" / "config.json").is_file() and result is not None
    shutil.rmtree(tmp_path / "c")
    assert fingerprint([source]) == before  # the source trained through its link is as it was


# ---- refusals -------------------------------------------------------------------------------------------------------


def _nanogpt(src: Path, ids=None, name: str = "train.bin") -> Path:
    (stream(20_000) if ids is None else np.asarray(ids)).astype(np.uint16).tofile(src / name)
    return src / name


def _megatron_changed(src: Path, change) -> Path:
    """A good Megatron dataset (40 documents, 80 sequences) with CHANGE(idx bytearray, S) applied to its .idx."""
    megatron_docs(src / "ds", documents(40))
    idx = bytearray((src / "ds.idx").read_bytes())
    change(idx, 80)
    (src / "ds.idx").write_bytes(bytes(idx))
    return src / "ds"


def _put(idx: bytearray, offset: int, fmt: str, value) -> None:
    idx[offset : offset + struct.calcsize(fmt)] = struct.pack(fmt, value)


LENGTHS, POINTERS = 34, 34 + 4 * 80
DOCUMENTS = POINTERS + 8 * 80

REFUSALS = {
    # case: (build(src) -> (sources, format, options), the message)
    "past-vocabulary": (
        lambda src: ([_nanogpt(src, [*stream(3000)[:1234], 600, *stream(3000)])], "nanogpt", {}),
        r"train.bin: token id 600 at byte 2,468 is past the tokenizer's 512 ids",
    ),
    "at-vocabulary": (  # the first id past the vocabulary: ids run from 0 to size - 1
        lambda src: ([_nanogpt(src, [*stream(3000)[:10], VOCAB, *stream(3000)])], "nanogpt", {}),
        r"train.bin: token id 512 at byte 20 is past the tokenizer's 512 ids",
    ),
    "negative": (
        lambda src: (
            [np.save(src / "a.npy", np.array([5, 6, -3, 0] * 300, np.int16)) or src / "a.npy"],
            "numpy",
            {"copy": True},
        ),
        r"a.npy: token id -3 at byte 132 is negative",
    ),  # fmt: skip
    "odd-size": (
        lambda src: [(src / "t.bin").write_bytes(b"\x01\x00" * 500 + b"\x01"), ([src / "t.bin"], "nanogpt", {})][1],
        r"holds 1,001 bytes, not a whole number of uint16 ids",
    ),
    "empty": (lambda src: [(src / "t.bin").touch(), ([src / "t.bin"], "nanogpt", {})][1], r"t.bin is empty"),
    "fifo": (lambda src: [os.mkfifo(src / "t.bin"), ([src / "t.bin"], "nanogpt", {})][1], "not a regular file"),
    "folder": (lambda src: ([src], "nanogpt", {}), r"is a folder: name the token files"),
    "missing": (lambda src: ([src / "nope.bin"], "nanogpt", {}), r"nope.bin: no such file"),
    "hub-name": (lambda src: (["HuggingFaceFW/fineweb-edu"], "nanogpt", {}), r"--from-tokens adopts local token files"),
    "named-twice": (
        lambda src: [
            os.link(_nanogpt(src), src / "again.bin"),
            ([src / "train.bin", src / "again.bin"], "nanogpt", {"copy": True}),
        ][1],
        r"is named twice among the sources",
    ),  # fmt: skip
    "several-without-copy": (
        lambda src: ([_nanogpt(src, name="a.bin"), _nanogpt(src, name="b.bin")], "nanogpt", {}),
        r"2 files are joined into one token stream: .* pass --copy",
    ),
    "npy-header-without-copy": (
        lambda src: ([np.save(src / "a.npy", stream(2000).astype(np.uint16)) or src / "a.npy"], "numpy", {}),
        r"has a 128-byte .npy header before its ids: .* pass --copy",
    ),
    "npy-2d": (
        lambda src: ([np.save(src / "a.npy", np.zeros((4, 5), np.uint16)) or src / "a.npy"], "numpy", {"copy": True}),
        r"holds a 4x5 <u2 array; token ids are one C-order array",
    ),
    "npy-float": (
        lambda src: ([np.save(src / "a.npy", np.zeros(50, np.float32)) or src / "a.npy"], "numpy", {"copy": True}),
        r"holds a 50 <f4 array",
    ),
    "dtype-not-numpy": (lambda src: ([_nanogpt(src)], "nanogpt", {"dtype": "uint32"}), r"--dtype .* numpy only"),
    "raw-numpy-past-vocabulary": (  # the same bytes read as uint32: ids past the vocabulary
        lambda src: ([_nanogpt(src, name="a.npy")], "numpy", {"dtype": "uint32"}),
        r"a.npy: token id \d+ at byte \d+ is past the tokenizer's 512 ids",
    ),
    "megatron-without-eos": (
        lambda src: (
            [megatron_docs(src / "ds", documents(30, eos_every=2)) is not None and src / "ds"],
            "megatron",
            {},
        ),
        r"ds.bin: the document ending at token \d+ does not end with the tokenizer's EOS \(0\): .* pass --copy",
    ),  # fmt: skip
    "megatron-no-idx": (
        lambda src: [
            megatron_docs(src / "ds", documents(5)),
            (src / "ds.idx").unlink(),
            ([src / "ds"], "megatron", {}),
        ][2],
        r"ds.idx: no such file \(a Megatron dataset is PREFIX.bin beside PREFIX.idx\)",
    ),  # fmt: skip
    "idx-truncated-header": (
        lambda src: ([_megatron_changed(src, lambda idx, n: idx.__delitem__(slice(20, None)))], "megatron", {}),
        r"ds.idx is truncated: 20 bytes, shorter than the 34-byte Megatron index header",
    ),
    "idx-truncated-arrays": (
        lambda src: ([_megatron_changed(src, lambda idx, n: idx.__delitem__(slice(-8, None)))], "megatron", {}),
        r"ds.idx holds 1,314 bytes, not the 1,322 .* its counts of 80 sequences and 41 document entries say",
    ),
    "idx-magic": (
        lambda src: ([_megatron_changed(src, lambda idx, n: idx.__setitem__(0, ord("X")))], "megatron", {}),
        r"ds.idx does not start with b'MMIDIDX",
    ),
    "idx-version": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, 9, "<Q", 2))], "megatron", {}),
        r"ds.idx is Megatron index version 2",
    ),
    "idx-float-dtype": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, 17, "<B", 7))], "megatron", {}),
        r"dtype code 7 is float32, not an integer token id type",
    ),
    "idx-unknown-dtype": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, 17, "<B", 9))], "megatron", {}),
        r"dtype code 9 is unknown",
    ),
    "idx-count": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, 18, "<Q", 81))], "megatron", {}),
        r"not the .* its counts of 81 sequences",
    ),
    "negative-length": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, LENGTHS + 4 * 3, "<i", -1))], "megatron", {}),
        r"a sequence length is negative \(-1\)",
    ),
    "pointer-gap": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, POINTERS + 8 * 7, "<q", 10**6))], "megatron", {}),
        r"sequence 7 starts at byte 1,000,000 of the .bin, not at [\d,]+ where the one before it ends",
    ),  # fmt: skip
    "past-the-bin": (
        lambda src: [
            _megatron_changed(src, lambda idx, n: None),
            (src / "ds.bin").write_bytes((src / "ds.bin").read_bytes()[:-4]),
            ([src / "ds"], "megatron", {}),
        ][2],
        r"ds.idx: its sequences reach byte [\d,]+, past the [\d,]+ of .*ds.bin",
    ),  # fmt: skip
    "bin-longer": (
        lambda src: [
            _megatron_changed(src, lambda idx, n: None),
            (src / "ds.bin").write_bytes((src / "ds.bin").read_bytes() + b"\x01\x00"),
            ([src / "ds"], "megatron", {}),
        ][2],
        r"ds.idx: its sequences end at byte [\d,]+, but .*ds.bin holds",
    ),  # fmt: skip
    "documents-out-of-order": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, DOCUMENTS + 8 * 5, "<q", 1))], "megatron", {}),
        r"document index entry 5 is 1: out of order",
    ),
    "documents-out-of-range": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, DOCUMENTS + 8 * 40, "<q", 99))], "megatron", {}),
        r"document index entry 40 is 99: out of order or out of the 0 to 80 sequences",
    ),  # fmt: skip
    "documents-end-early": (
        lambda src: ([_megatron_changed(src, lambda idx, n: _put(idx, DOCUMENTS + 8 * 40, "<q", 78))], "megatron", {}),
        r"the document index ends at sequence 78, not at the 80 sequences",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_bad_source_is_refused_in_one_line_leaving_nothing(case, tokenizer_dir, tmp_path):  # noqa: F811
    src = tmp_path / "src"
    src.mkdir()
    build, match = REFUSALS[case]
    sources, fmt, options = build(src)
    files = sorted(p for p in src.iterdir() if p.is_file() and not p.is_fifo()) if src.exists() else []
    before = fingerprint(files)
    out = tmp_path / "corpus"
    with pytest.raises(KHAError, match=match) as refused:
        adopt(sources, tokenizer_dir, out, fmt, **options)
    assert "\n" not in str(refused.value)
    assert not out.exists() and not list(tmp_path.glob(".kha-*"))
    assert fingerprint(files) == before  # bytes, size, time and link count: a link made on the way was removed


def test_the_output_may_not_be_a_source(tokenizer_dir, tmp_path):  # noqa: F811
    source = _nanogpt(tmp_path)
    before = fingerprint([source])
    with pytest.raises(KHAError, match="is the source"):
        adopt([source], tokenizer_dir, source, "nanogpt")
    assert fingerprint([source]) == before and not list(tmp_path.glob(".kha-*"))


def test_a_link_across_file_systems_names_copy(tokenizer_dir, tmp_path):  # noqa: F811
    if not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second file system (/dev/shm) to link across")
    elsewhere = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        source = _nanogpt(elsewhere)
        before = fingerprint([source])
        with pytest.raises(KHAError, match=r"cannot hard-link .*train.bin .*cross file systems\): pass --copy"):
            adopt([source], tokenizer_dir, tmp_path / "c", "nanogpt")
        assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".kha-*"))
        assert fingerprint([source]) == before
        adopt([source], tokenizer_dir, tmp_path / "c", "nanogpt", copy=True)
        assert tokens_of(tmp_path / "c").tolist() == np.fromfile(source, np.uint16).tolist()
    finally:
        shutil.rmtree(elsewhere)


def test_the_cli_adopts_and_refuses_in_one_line(tokenizer_dir, tmp_path, capsys):  # noqa: F811
    source = _nanogpt(tmp_path)
    common = ["--tokenizer", str(tokenizer_dir), "--output"]
    assert main(["tokenize", str(source), "--from-tokens", "nanogpt", *common, str(tmp_path / "c")]) == 0
    assert "adopted (hard-linked)" in capsys.readouterr().out and open_corpus(tmp_path / "c").tokens == 20_000
    for extra, message in (
        (["--from-tokens", "nanogpt", "--split", "train"], "--split do not apply to --from-tokens"),
        (["--from-tokens", "nanogpt", "--workers", "2"], "--workers do not apply to --from-tokens"),
        (["--copy"], "--copy apply only with --from-tokens"),
    ):
        assert main(["tokenize", str(source), *extra, *common, str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kha tokenize: error: ") and message in err[0], err
        assert not (tmp_path / "d").exists()
    _nanogpt(tmp_path, [*stream(3000), 700], name="bad.bin")
    assert main(["tokenize", str(tmp_path / "bad.bin"), "--from-tokens", "nanogpt", *common, str(tmp_path / "d")]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("checking:")]  # no bar
    assert len(err) == 1 and "token id 700 at byte 6,000 is past the tokenizer's 512 ids" in err[0], err
    assert not (tmp_path / "d").exists() and not list(tmp_path.glob(".kha-*"))


# ---- the attack round of 2026-12-07 (#70): races and a lying header ------------------------------------------------


def test_a_npy_header_that_states_a_gigabyte_is_refused_before_it_is_read(tokenizer_dir, tmp_path):  # noqa: F811
    src = tmp_path / "big.npy"
    with open(src, "wb") as f:  # a sparse file: numpy would read the 1 GiB header whole before checking it
        f.write(b"\x93NUMPY\x02\x00" + struct.pack("<I", 1 << 30))
        f.truncate(12 + (1 << 30) + 64)
    with pytest.raises(KHAError, match=r"states a .npy header of 1,073,741,824 bytes: not a token array's"):
        adopt([src], tokenizer_dir, tmp_path / "corpus", "numpy", copy=True)
    assert not (tmp_path / "corpus").exists() and not list(tmp_path.glob(".kha-*"))


@pytest.mark.parametrize("fmt", ["numpy", "megatron"])
def test_a_source_made_a_fifo_after_its_check_is_refused_not_waited_on(
    fmt,
    tokenizer_dir,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    import signal

    import kha_hf.data.adopt as adopt_module

    if fmt == "numpy":
        src = tmp_path / "ids.npy"
        np.save(src, stream(2000).astype("<u2"))
        victim = src
    else:
        megatron_docs(tmp_path / "ds", documents(20))
        src, victim = tmp_path / "ds", tmp_path / "ds.idx"
    loaded = adopt_module.load_corpus_tokenizer

    def fifo_in_its_place(*args, **kwargs):  # another process wins the race while the tokenizer loads
        tokenizer = loaded(*args, **kwargs)
        victim.unlink()
        os.mkfifo(victim)
        return tokenizer

    monkeypatch.setattr(adopt_module, "load_corpus_tokenizer", fifo_in_its_place)
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("adoption blocked on a FIFO"))
    signal.alarm(60)
    try:
        with pytest.raises(KHAError, match="not a regular file|replaced by another file"):
            adopt([src], tokenizer_dir, tmp_path / "corpus", fmt, copy=True)
    finally:
        signal.alarm(0)
    assert not (tmp_path / "corpus").exists() and not list(tmp_path.glob(".kha-*"))


def test_a_megatron_index_rewritten_after_its_check_is_refused(tokenizer_dir, tmp_path, monkeypatch):  # noqa: F811
    import kha_hf.data.adopt as adopt_module

    megatron_docs(tmp_path / "ds", documents(20))
    checked = adopt_module.read_megatron_index

    def rewritten_after_the_check(name):
        index = checked(name)
        with open(tmp_path / "ds.idx", "r+b") as f:  # the same size, a document index the checks would refuse
            f.seek(index._documents_at + 8)
            f.write(np.asarray([0, 0], "<i8").tobytes())
        return index

    monkeypatch.setattr(adopt_module, "read_megatron_index", rewritten_after_the_check)
    with pytest.raises(KHAError, match="ds.idx changed while it was read: adopt it again"):
        adopt([tmp_path / "ds"], tokenizer_dir, tmp_path / "corpus", "megatron")
    assert not (tmp_path / "corpus").exists() and not list(tmp_path.glob(".kha-*"))
