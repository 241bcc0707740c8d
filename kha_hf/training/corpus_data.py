"""Training data from `--data`: a prepared corpus (read lazily, flat memory) or raw text that fits in memory.

A raw corpus is tokenized in memory at about 160 bytes a token (Python lists of ints, then a tensor, measured
2026-12-05: 20 MB of text took 1.0 GiB). Rather than run out of memory, raw `--data` whose text would not fit in
what this machine has free is refused in one line that names `kha tokenize`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..common.errors import KHAError
from ..data.corpus import PreparedCorpus, TokenBlockFile, is_prepared_corpus, open_corpus

RAW_BYTES_OF_MEMORY_PER_TEXT_BYTE = 60  # ~160 bytes a token / ~3 bytes of text a token, with some margin
MAX_PREPARED_EVAL_BLOCKS = 256  # held-out blocks evaluated from a prepared corpus (its split may be millions)
RUN_RECORD = "kha_data.json"  # in a run's folder: the data it trains on, checked by --resume


def prepared_corpus(data: list[str] | None) -> PreparedCorpus | None:
    """The prepared corpus `--data` names (opened and checked), or None for raw text sources (or none), which are
    refused first where they would not fit in memory (`check_raw_data_fits`)."""
    prepared = [d for d in data or [] if is_prepared_corpus(d)]
    if not prepared:
        check_raw_data_fits(data)
        return None
    if len(data) > 1:
        raise KHAError(
            f"{prepared[0]} is a prepared corpus: pass it alone to --data (prepare several sources together)"
        )
    corpus = open_corpus(prepared[0])
    corpus.check_sources_unchanged()
    return corpus


def check_raw_data_fits(data: list[str] | None) -> None:
    """Refuse raw text files whose in-memory tokenizing would not fit in the memory available now."""
    total = 0
    for name in data or []:
        path = Path(name).expanduser()
        files = path.rglob("*") if path.is_dir() else [path]
        total += sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())
    available = available_memory()
    needed = total * RAW_BYTES_OF_MEMORY_PER_TEXT_BYTE
    if available is not None and needed > available:
        raise KHAError(
            f"--data holds {total / 2**20:.0f} MiB of text, about {needed / 2**30:.1f} GiB once tokenized in "
            f"memory, more than the {available / 2**30:.1f} GiB free: prepare it once with kha tokenize SRC... "
            "--tokenizer MODEL --output DIR and pass --data DIR"
        )


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def corpus_splits(
    corpus: PreparedCorpus, tokenizer, seq_len: int, max_eval_blocks: int | None = None
) -> tuple[TokenBlockFile, TokenBlockFile]:
    """(train, held-out) blocks of a prepared corpus, after checking the tokenizer is the one that prepared it."""
    corpus.check_tokenizer(tokenizer)
    train = corpus.blocks("train", seq_len)
    heldout = corpus.blocks("heldout", seq_len, max_eval_blocks or MAX_PREPARED_EVAL_BLOCKS)
    if len(train) == 0 or len(heldout) == 0:
        raise KHAError(f"{corpus.folder} holds fewer train or held-out tokens than one block of {seq_len}")
    return train, heldout


def check_vocabulary_fits(corpus: PreparedCorpus, vocab_size: int | None, *block_files: TokenBlockFile) -> None:
    """A token id at or past the model's vocabulary would index past its embedding: refused from the manifest now,
    and by each block as it is read (the manifest may lie)."""
    largest = corpus.manifest.get("max_token_id")
    if vocab_size is not None and isinstance(largest, int) and largest >= vocab_size:
        raise KHAError(f"{corpus.folder} holds token id {largest}, past the model's vocabulary of {vocab_size}")
    for blocks in block_files:
        blocks.id_limit = vocab_size


def run_record(corpus: PreparedCorpus | None, data: list[str] | None, seed: int, seq_len: int) -> dict:
    """What a run's data position depends on: the corpus (its manifest's hash), the seed and the block length."""
    if corpus is not None:
        source = {"corpus": str(corpus.folder), "manifest_sha256": corpus.manifest_sha256}
    else:
        source = {"corpus": None, "data": sorted(str(Path(d).expanduser().absolute()) for d in data or [])}
    return {**source, "seed": seed, "seq_len": seq_len}


def write_run_record(folder: Path, record: dict) -> None:
    if not (folder / RUN_RECORD).exists():
        (folder / RUN_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def _written_by(folder: Path) -> str | None:
    """The kha-hf version FOLDER's `.kha-output` marker names (markers written since 2026-12-07), or None."""
    from ..checkpoint.paths import OUTPUT_MARKER
    from ..common.text_files import read_json_object

    try:
        version = read_json_object(folder / OUTPUT_MARKER, 4096).get("version")
    except (KHAError, OSError):
        return None
    return version if isinstance(version, str) else None


def check_resumed_record(folder: Path | None, record: dict) -> None:
    """`--resume` continues the run it resumes: the same corpus, seed and block length, or a one-line refusal."""
    if folder is None:
        return
    path = folder / RUN_RECORD
    if not (path.exists() or path.is_symlink()):
        version = _written_by(folder)
        if version is None:
            return  # an older run: kha-hf 0.6 recorded nothing, and markers named no version before 2026-12-07
        raise KHAError(
            f"{path} is missing: kha-hf {version} wrote this run with its record (corpus, seed, block length), which "
            "--resume checks; start a new run"
        )
    if path.is_symlink() or not path.is_file():
        raise KHAError(f"{path} is not a regular file: not the record kha train wrote; start a new run")
    try:
        kept = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KHAError(f"cannot read {path}: {err}") from err
    if not isinstance(kept, dict):
        raise KHAError(f"{path} is not the record kha train wrote")
    for key, what in (("manifest_sha256", "corpus"), ("data", "data"), ("seed", "seed"), ("seq_len", "--seq-len")):
        if kept.get(key) != record.get(key):
            raise KHAError(
                f"--resume with another {what} than the run it resumes ({kept.get(key)!r} there, {record.get(key)!r} "
                f"now): give the run's own, or start a new run"
            )
