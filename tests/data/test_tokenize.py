"""`kha tokenize` and the prepared corpus: the same tokens as the in-memory `pack`, splits that never train, a manifest
that records what it says, skipped input counted, and one-line refusals that leave nothing half-written."""

import copy
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from tokenizers.processors import TemplateProcessing

from kha_hf.common.errors import KHAError
from kha_hf.data import sources as sources_module
from kha_hf.data.chunks import CHUNKS, ChunkHasher
from kha_hf.data.corpus import open_corpus
from kha_hf.data.prepare import tokenize_corpus
from kha_hf.training.data import pack, read_documents
from kha_hf.training.tokenizer import train_bpe_tokenizer

PLAYS = read_documents(None)[:3]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(PLAYS, 512).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tokenizer_dir, tmp_path_factory):
    """The same tokenizer, leading every encoding with BOS (as Gemma's and Llama 3's do)."""
    from transformers import AutoTokenizer

    tok = copy.deepcopy(AutoTokenizer.from_pretrained(tokenizer_dir))
    tok.add_special_tokens({"bos_token": "<bos>"})
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.bos_token_id)]
    )
    folder = tmp_path_factory.mktemp("tok-bos")
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def plays_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plays")
    for i, play in enumerate(PLAYS):
        (folder / f"play{i}.md").write_text(play[:40000])
    return folder


def kha(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kha_hf", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        **kwargs,
    )


def test_tokens_are_packs_stream_and_blocks_are_packs_blocks(plays_dir, tokenizer_dir, bos_tokenizer_dir, tmp_path):
    """The corpus holds exactly the stream `pack` builds in memory (documents joined with EOS, sorted file order),
    and its blocks are pack's blocks, BOS first where the tokenizer leads with it."""
    from transformers import AutoTokenizer

    docs = [p.read_text() for p in sorted(plays_dir.glob("*.md"))]
    for tok_dir in (tokenizer_dir, bos_tokenizer_dir):
        tok = AutoTokenizer.from_pretrained(tok_dir)
        out = tmp_path / tok_dir.name
        manifest = tokenize_corpus([str(plays_dir)], tok_dir, out, workers=2, disable_tqdm=True)
        corpus = open_corpus(out)
        tokens = np.fromfile(out / "tokens.bin", dtype=np.uint16)
        stream = [t for d in docs for t in [*tok(d, add_special_tokens=False)["input_ids"], tok.eos_token_id]]
        assert tokens.tolist() == stream
        assert manifest["tokens"] == len(stream) and manifest["documents"] == 3
        whole = corpus.blocks("train", 64)
        train_end = corpus.splits["train"][1]
        expected = pack(docs, tok, 64)  # pack's blocks, up to where the held-out splits begin
        n = len(whole)
        assert n == train_end // (64 - (corpus.manifest["tokenizer"]["leading_bos"] is not None))
        assert torch.equal(torch.stack([whole[i]["input_ids"] for i in range(n)]), expected[:n])


def test_splits_are_the_streams_tail_and_never_train(plays_dir, tokenizer_dir, tmp_path):
    manifest = tokenize_corpus(
        [str(plays_dir)], tokenizer_dir, tmp_path / "c", eval_fraction=0.1, disable_tqdm=True, workers=1
    )
    n = manifest["tokens"]
    held = int(n * 0.1)
    assert manifest["splits"] == {
        "train": [0, n - 2 * held],
        "validation": [n - 2 * held, n - held],
        "heldout": [n - held, n],
    }
    corpus = open_corpus(tmp_path / "c")
    train, heldout = corpus.blocks("train", 32), corpus.blocks("heldout", 32)
    # the last train block ends before the validation split starts; the held-out reader starts at its split
    assert (train.start + len(train) * train.body) <= corpus.splits["validation"][0]
    assert heldout.start == corpus.splits["heldout"][0]
    capped = tokenize_corpus(
        [str(plays_dir)], tokenizer_dir, tmp_path / "d", max_eval_tokens=100, disable_tqdm=True, workers=1
    )
    assert capped["splits"]["heldout"][1] - capped["splits"]["heldout"][0] == 100


def test_manifest_records_tokenizer_sources_and_dtype(plays_dir, tokenizer_dir, tmp_path):
    manifest = tokenize_corpus([str(plays_dir)], tokenizer_dir, tmp_path / "c", disable_tqdm=True, workers=1)
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["size"] == 512
    assert manifest["tokenizer"]["special_token_ids"]["eos"] == 0
    for record, path in zip(manifest["sources"], sorted(plays_dir.glob("*.md")), strict=True):
        data = path.read_bytes()
        assert record["name"] == str(path) and record["bytes"] == len(data)
        assert record["sha256"] == hashlib.sha256(data).hexdigest() and record["documents"] == 1
    assert manifest["tokens_sha256"] == hashlib.sha256((tmp_path / "c" / "tokens.bin").read_bytes()).hexdigest()
    assert json.loads((tmp_path / "c" / "manifest.json").read_text()) == manifest
    assert (tmp_path / "c" / "tokenizer" / "tokenizer.json").is_file()


def test_bad_documents_are_counted_and_reported(tokenizer_dir, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    lines = [
        json.dumps({"text": "a good line"}),
        json.dumps({"title": "no text"}),
        json.dumps({"text": 7}),
        "not json",
        json.dumps({"text": "   "}),
        "",
        json.dumps({"text": "x" * 5000}),  # past the (lowered) line limit: skipped as it streams past
        json.dumps({"text": "another good line"}),
    ]
    (src / "a.jsonl").write_text("\n".join(lines) + "\n")
    (src / "b.txt").write_bytes(b"fine line\nbad \xff\xfe line\nlast line\n")
    (src / "c.md").write_text("  \n\n")
    (src / "d.parquet").write_bytes(_parquet([{"text": "parquet row"}, {"text": None}, {"text": ""}]))
    monkeypatch.setattr(sources_module, "MAX_JSON_LINE", 1000)
    manifest = tokenize_corpus([str(src)], tokenizer_dir, tmp_path / "c", disable_tqdm=True, workers=1)
    assert manifest["skipped"] == {"empty": 3, "undecodable": 1, "no_text": 4, "too_long": 1}
    assert manifest["documents"] == 4  # two JSON lines, the text file, one Parquet row
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = tok.decode(np.fromfile(tmp_path / "c" / "tokens.bin", dtype=np.uint16).tolist())
    assert "a good line" in text and "another good line" in text and "fine line\nlast line" in text
    assert "parquet row" in text and "bad" not in text and "no text" not in text


def _parquet(rows) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


def test_a_long_document_streams_in_pieces_with_the_same_tokens(tokenizer_dir, tmp_path, monkeypatch):
    """A document far larger than a piece is read in pieces, cut before a space between words: its tokens are
    those of the whole document; a line of 16 pieces without such a space is cut at a character boundary."""
    from transformers import AutoTokenizer

    monkeypatch.setattr(sources_module, "PIECE_BYTES", 4096)
    text = PLAYS[0][:60000] + "\n" + "é" * 40000 + "\n"  # 80 kB in one line: 20 pieces
    (tmp_path / "long.txt").write_text(text)
    tokenize_corpus([str(tmp_path / "long.txt")], tokenizer_dir, tmp_path / "c", disable_tqdm=True, workers=1)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = np.fromfile(tmp_path / "c" / "tokens.bin", dtype=np.uint16).tolist()
    assert tok.decode(ids[:-1]) == text  # nothing lost or doubled at the cuts, one EOS at the end
    lines = text[: text.index("é")]  # every cut in here falls before a word: the tokens of the text read whole
    whole = tok(lines, add_special_tokens=False)["input_ids"]
    assert ids[: len(whole)] == whole


@pytest.mark.parametrize(
    "case, match",
    [
        ("nothing", "name at least one source"),
        ("missing", "no such file or folder"),
        ("fifo", "not a regular file"),
        ("fifo-in-folder", "not a regular file"),
        ("suffix", "unsupported file type"),
        ("output-in-source", "inside"),
        ("empty-folder", "holds no"),
    ],
)
def test_bad_sources_are_refused_in_one_line(case, match, tokenizer_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("some text " * 200)
    args, out = [str(src)], tmp_path / "out"
    if case == "nothing":
        args = []
    elif case == "missing":
        args = [str(tmp_path / "nope.txt")]
    elif case == "fifo":
        os.mkfifo(tmp_path / "pipe.txt")
        args = [str(tmp_path / "pipe.txt")]
    elif case == "fifo-in-folder":
        os.mkfifo(src / "pipe.jsonl")
    elif case == "suffix":
        (tmp_path / "x.csv").write_text("a,b")
        args = [str(tmp_path / "x.csv")]
    elif case == "output-in-source":
        out = src / "out"
    elif case == "empty-folder":
        (tmp_path / "empty").mkdir()
        args = [str(tmp_path / "empty")]
    with pytest.raises(KHAError, match=match):
        tokenize_corpus(args, tokenizer_dir, out, disable_tqdm=True, workers=1)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.endswith(".partial")]


def test_a_full_disk_fails_in_one_line_and_leaves_nothing(plays_dir, tokenizer_dir, tmp_path):
    """A file-size limit (as a full disk would) stops the write of tokens.bin: exit 2, one line, no output, no
    temporary folder."""
    out = tmp_path / "c"
    limit = 60_000  # bytes a file: the tokenizer's files fit (about 21 kB), the tokens (about 120 kB) do not

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill, as ENOSPC would be
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = kha("tokenize", plays_dir, "--tokenizer", tokenizer_dir, "--output", out, preexec_fn=limited)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "kha tokenize: error:" in errors[0], proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".kha-*"))


def test_a_killed_run_never_leaves_a_corpus_that_looks_complete(tokenizer_dir, tmp_path):
    """SIGKILL while tokenizing: no output folder, and the temporary folder left behind is refused as a corpus."""
    src = tmp_path / "big.jsonl"
    with open(src, "w") as f:
        for i in range(40000):
            f.write(json.dumps({"text": PLAYS[i % 3][(i * 97) % 30000 :][:400]}) + "\n")
    out = tmp_path / "c"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kha_hf", "tokenize", str(src), "--tokenizer", str(tokenizer_dir), "--output", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not any(
        (p / "tokens.bin").is_file() and (p / "tokens.bin").stat().st_size > 0 for p in tmp_path.glob(".kha-*")
    ):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    partials = list(tmp_path.glob(".kha-*.partial"))
    assert partials, "the run was killed before it wrote tokens: make the input larger"
    with pytest.raises(KHAError, match="not a prepared corpus"):
        open_corpus(partials[0])
    # the next run of the same output removes the dead run's folder and completes
    assert kha("tokenize", src, "--tokenizer", tokenizer_dir, "--output", out).returncode == 0
    assert open_corpus(out).tokens > 0 and not list(tmp_path.glob(".kha-*.partial"))


def test_a_damaged_corpus_is_refused_in_one_line(plays_dir, tokenizer_dir, tmp_path):
    tokenize_corpus([str(plays_dir)], tokenizer_dir, tmp_path / "c", disable_tqdm=True, workers=1)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    with open(tmp_path / "c" / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(KHAError, match="damaged or unfinished"):
        open_corpus(tmp_path / "c")
    tokenize_corpus([str(plays_dir)], tokenizer_dir, tmp_path / "d", disable_tqdm=True, workers=1)
    for bad in (
        {**manifest, "splits": {**manifest["splits"], "train": [0, manifest["splits"]["train"][1] + 1]}},
        {**manifest, "dtype": "float32"},
        {**manifest, "version": 99},
        [1, 2],
    ):
        (tmp_path / "d" / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(KHAError):
            open_corpus(tmp_path / "d")


def test_another_tokenizer_is_refused(plays_dir, tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenize_corpus([str(plays_dir)], tokenizer_dir, tmp_path / "c", disable_tqdm=True, workers=1)
    corpus = open_corpus(tmp_path / "c")
    corpus.check_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir))  # its own: accepted
    other = train_bpe_tokenizer(PLAYS[1:], 512)  # same size, another vocabulary
    with pytest.raises(KHAError, match="another tokenizer.*another vocabulary"):
        corpus.check_tokenizer(other)


def test_a_changed_source_is_refused(plays_dir, tokenizer_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("some text " * 300)
    tokenize_corpus([str(src)], tokenizer_dir, tmp_path / "c", disable_tqdm=True, workers=1)
    open_corpus(tmp_path / "c").check_sources_unchanged()
    (src / "a.txt").write_text("other text " * 300)
    with pytest.raises(KHAError, match="changed since"):
        open_corpus(tmp_path / "c").check_sources_unchanged()
    (src / "a.txt").unlink()  # a source that is gone: the corpus holds its text
    open_corpus(tmp_path / "c").check_sources_unchanged()


def test_a_source_appended_to_while_it_is_read_is_recorded_as_read(tokenizer_dir, tmp_path, monkeypatch, capsys):
    """#70 item 13: the record held the bytes read with the time taken at open, and every later --data refused the
    corpus as "changed". It holds the file as read now: the appended text included, its time once read."""
    src = tmp_path / "a.txt"
    src.write_text("some text " * 300)
    chunks = sources_module._hashed_chunks

    def appending(f, source, digest):
        for i, chunk in enumerate(chunks(f, source, digest)):
            yield chunk
            if i == 0:  # another process appends once the first chunk was read
                time.sleep(0.01)  # a later modification time than at open, on any clock resolution
                with open(src, "a") as other:
                    other.write("more text " * 50)

    monkeypatch.setattr(sources_module, "_hashed_chunks", appending)
    manifest = tokenize_corpus([str(src)], tokenizer_dir, tmp_path / "c", disable_tqdm=True, workers=1)
    assert f"{src} changed while it was read" in capsys.readouterr().out
    assert manifest["sources"][0]["bytes"] == src.stat().st_size  # the appended text is in the corpus
    open_corpus(tmp_path / "c").check_sources_unchanged()  # not a false "changed since"


def test_text_without_spaces_is_cut_into_pieces(tokenizer_dir, tmp_path):
    """Text with no word boundary (Chinese, a blob) reaches the tokenizer in pieces of about PIECE_BYTES, never in
    one (a tokenizer holds ~200 bytes a token while it encodes: 16 MiB of it took 3.5 GB, found by review)."""
    src = tmp_path / "blob.txt"
    src.write_text("日本語" * 800_000)  # 7.2 MB, no space
    source = sources_module.resolve_sources([str(src)])[0]
    sizes = [len(p.text.encode()) for p in sources_module.read_pieces(source)]
    assert len(sizes) > 5 and max(sizes) <= sources_module.PIECE_BYTES + 4  # + a character carried over
    assert sum(sizes) == src.stat().st_size


def test_hostile_values_are_counted_not_crashed_on(tokenizer_dir, tmp_path, monkeypatch):
    """A lone surrogate in JSON ("\\ud800") is no text (it was a TypeError traceback); a Parquet value past the
    line limit is skipped without its Python copy being made; an empty source name and a file named twice are
    refused."""
    monkeypatch.setattr(sources_module, "MAX_JSON_LINE", 1000)
    (tmp_path / "s.jsonl").write_text('{"text": "\\ud800 hello"}\n{"text": "fine words here"}\n')
    (tmp_path / "big.parquet").write_bytes(_parquet([{"text": "y" * 5000}, {"text": "short text"}]))
    manifest = tokenize_corpus(
        [str(tmp_path / "s.jsonl"), str(tmp_path / "big.parquet")], tokenizer_dir, tmp_path / "c", workers=1,
        disable_tqdm=True, eval_fraction=0.2,
    )  # fmt: skip
    assert manifest["skipped"]["undecodable"] == 1 and manifest["skipped"]["too_long"] == 1
    assert manifest["documents"] == 2
    with pytest.raises(KHAError, match="empty source name"):
        tokenize_corpus([""], tokenizer_dir, tmp_path / "d", workers=1, disable_tqdm=True)
    with pytest.raises(KHAError, match="named twice"):
        tokenize_corpus([str(tmp_path), str(tmp_path / "s.jsonl")], tokenizer_dir, tmp_path / "e", workers=1)


def test_a_malformed_tokenizer_is_one_line(plays_dir, tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}')
    proc = kha("tokenize", plays_dir, "--tokenizer", tmp_path / "tok", "--output", tmp_path / "c")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("kha tokenize: error: cannot load a tokenizer")


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": ["uint16"]},
        {"sources": ["a", "b"]},
        {"sources": [{"name": None, "kind": "file", "bytes": 1}]},
        {"sources": [{"name": 0, "kind": "file", "bytes": 1, "mtime_ns": 1}]},
        {"sources": [{"name": "x", "kind": "file"}]},
        {"max_token_id": "511"},
        {"tokenizer": {"size": "512"}},
    ],
)
def test_a_manifest_of_the_wrong_shape_is_refused(change, plays_dir, tokenizer_dir, tmp_path):
    tokenize_corpus([str(plays_dir)], tokenizer_dir, tmp_path / "c", workers=1, disable_tqdm=True)
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    (tmp_path / "c" / "manifest.json").write_text(json.dumps({**manifest, **change}))
    with pytest.raises(KHAError):
        open_corpus(tmp_path / "c")


def test_ids_past_the_vocabulary_are_refused_as_blocks_are_read(plays_dir, tokenizer_dir, tmp_path):
    """A manifest that understates its largest id: each block is checked against the model's vocabulary as read."""
    tokenize_corpus([str(plays_dir)], tokenizer_dir, tmp_path / "c", workers=1, disable_tqdm=True)
    tokens = np.fromfile(tmp_path / "c" / "tokens.bin", dtype=np.uint16)
    tokens[100] = 60000
    tokens.tofile(tmp_path / "c" / "tokens.bin")
    # its author rewrote the chunk digests and the manifest to match (data/chunks.py would refuse the change alone)
    hasher = ChunkHasher()
    hasher.update(tokens.tobytes())
    (tmp_path / "c" / CHUNKS).write_bytes(digests := hasher.finish())
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["chunks_sha256"] = hashlib.sha256(digests).hexdigest()
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    blocks = open_corpus(tmp_path / "c").blocks("train", 64)
    blocks[1]  # read before the limit is known
    blocks.id_limit = 512
    blocks[0]
    with pytest.raises(KHAError, match="token id 60000 .* past the model's vocabulary of 512"):
        blocks[1]
