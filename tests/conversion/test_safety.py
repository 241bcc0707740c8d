"""`kha convert` / `kha fold` never lose, corrupt or expose files they were not asked to touch.

Destination checks (DST is SRC, holds SRC, is cwd/home/root, is not a checkpoint), confined shard names, the Hugging
Face cache layout (relative symlinks to blobs), complete header validation, races with the final rename, signals
and stale temporary folders.
"""

import json
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kha_hf import KHAForCausalLM
from kha_hf.checkpoint.output import PARTIAL_MARKER, remove_stale_partials
from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from kha_hf.conversion import convert
from kha_hf.conversion.converter import KNOCKS_FILE
from tests.conversion.test_convert import make_checkpoint, sha256_tree
from tests.helpers import run_at_work_in, tiny_base_model

IDS = torch.tensor([[3, 9, 27, 81, 5, 15]])


def _tree(folder: Path) -> dict[str, str]:
    return sha256_tree(folder) if folder.exists() else {}


def cli(capsys, argv) -> tuple[int, str]:
    """(exit code, stderr) of `kha ARGV`; an error must be exactly one line."""
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    if rc != 0:
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return rc, err


@pytest.fixture
def src(tmp_path) -> Path:
    folder = tmp_path / "p" / "src"
    make_checkpoint(folder)
    return folder


# 1. --overwrite never deletes what it must not -------------------------------------------------------------------
def test_dst_equal_to_src_is_refused(src, capsys):
    before = _tree(src)
    rc, err = cli(capsys, ["convert", str(src), str(src), "--overwrite"])
    assert rc == 2 and "is the source" in err
    assert _tree(src) == before


def test_dst_containing_src_is_refused_and_nothing_is_deleted(src, capsys):
    parent = src.parent
    (parent / "notes.txt").write_text("keep me")
    before = _tree(parent)
    rc, err = cli(capsys, ["convert", str(src), str(parent), "--overwrite"])
    assert rc == 2 and "contains the source" in err
    assert _tree(parent) == before


@pytest.mark.parametrize("where", ["cwd", "home", "root"])
def test_cwd_home_and_root_are_refused(src, tmp_path, monkeypatch, capsys, where):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.json").write_text("{}")  # looks like a checkpoint: the refusal must not depend on that
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home if where == "cwd" else tmp_path)
    target = {"cwd": ".", "home": str(home), "root": "/"}[where]
    before = _tree(home)
    rc, err = cli(capsys, ["convert", str(src), target, "--overwrite"])
    assert rc == 2 and "refusing to write" in err
    assert _tree(home) == before


def test_overwrite_refuses_a_folder_that_is_not_a_checkpoint(src, tmp_path, capsys):
    dst = tmp_path / "photos"
    dst.mkdir()
    (dst / "holiday.jpg").write_bytes(b"\xff\xd8")
    rc, err = cli(capsys, ["convert", str(src), str(dst), "--overwrite"])
    assert rc == 2 and "does not look like a folder kha wrote" in err
    assert (dst / "holiday.jpg").read_bytes() == b"\xff\xd8"


def test_overwrite_replaces_a_checkpoint_only_after_the_new_one_is_complete(src, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    convert(src, dst, progress=False)
    (dst / "marker").write_text("old")
    import kha_hf.conversion.converter as convert_module

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert_module, "_write_cast_shard", broken)
    with pytest.raises(KHAError) as full:
        convert(src, dst, overwrite=True, dtype="float16", progress=False)
    # DST whole, as docs/safety.md says (#70 item 15: it named the parent folder and the name apart)
    assert str(full.value) == f"no space left on the device while writing {dst}; nothing was put in place"
    assert (dst / "marker").read_text() == "old", "the old DST must survive a failed overwrite"
    monkeypatch.undo()
    convert(src, dst, overwrite=True, progress=False)
    assert not (dst / "marker").exists() and (dst / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out.", ".kha-"))]


def test_fold_refuses_its_own_source_and_a_parent_of_it(tmp_path, capsys):
    kha = KHAForCausalLM.from_base(tiny_base_model("llama"), knock="linear_qkv")
    kha.save_pretrained(tmp_path / "p" / "kha")
    before = _tree(tmp_path / "p")
    for target in (tmp_path / "p" / "kha", tmp_path / "p"):
        rc, err = cli(capsys, ["fold", str(tmp_path / "p" / "kha"), str(target), "--overwrite"])
        assert rc == 2 and ("is the source" in err or "contains the source" in err)
    assert _tree(tmp_path / "p") == before


# 3. Paths stay inside their folders ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["../outside.safetensors", "/tmp/abs.safetensors", "sub/../../x.safetensors"])
def test_shard_names_escaping_the_folder_are_refused(src, tmp_path, capsys, bad):
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = bad
    index_path.write_text(json.dumps(index))
    outside = _tree(tmp_path)
    rc, err = cli(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert rc == 2 and "plain file name" in err
    assert _tree(tmp_path) == outside and not (tmp_path / "out").exists()


def test_fold_refuses_escaping_shard_names(tmp_path, capsys):
    kha = KHAForCausalLM.from_base(tiny_base_model("llama"), knock="linear_qkv")
    kha.save_pretrained(tmp_path / "kha", max_shard_size="60KB")
    index_path = tmp_path / "kha" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "../../etc/passwd"
    index_path.write_text(json.dumps(index))
    rc, err = cli(capsys, ["fold", str(tmp_path / "kha"), str(tmp_path / "folded")])
    assert rc == 2 and "plain file name" in err and not (tmp_path / "folded").exists()


# 4. Hub-cache sources ------------------------------------------------------------------------------------------
def hub_cache_layout(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """models--o--n/{blobs/<name>, snapshots/rev/<name> -> ../../blobs/<name>}, as huggingface_hub writes it."""
    plain = tmp_path / "plain"
    model = make_checkpoint(plain)
    repo = tmp_path / "hub" / "models--o--n"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for path in plain.iterdir():
        blob = f"blob-{path.name}"
        (repo / "blobs" / blob).write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snapshot, model


@pytest.mark.parametrize("link", [False, True])
def test_hub_cache_layout_converts_without_dangling_links(tmp_path, link):
    snapshot, base = hub_cache_layout(tmp_path)
    out = convert(snapshot, tmp_path / "out", link=link, progress=False).output
    for path in out.iterdir():
        assert path.exists(), f"{path.name} dangles"
        assert not path.is_symlink(), f"{path.name} is a link into the cache"
        if link and path.suffix == ".safetensors" and path.name != KNOCKS_FILE:
            blob = snapshot.parent.parent / "blobs" / f"blob-{path.name}"
            assert os.path.samefile(path, blob), "--link must hard-link the blob itself"
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, base(IDS).logits)


def test_link_across_file_systems_falls_back_to_absolute_symlinks_and_says_so(tmp_path, monkeypatch, capsys):
    snapshot, base = hub_cache_layout(tmp_path)

    def no_hard_links(*args, **kwargs):
        raise OSError(18, "Invalid cross-device link")  # EXDEV

    monkeypatch.setattr(os, "link", no_hard_links)
    out = convert(snapshot, tmp_path / "out", link=True, progress=False).output
    assert "symbolic links to the originals" in capsys.readouterr().out
    shards = [p for p in out.glob("*.safetensors") if p.name != KNOCKS_FILE]
    assert shards and all(p.is_symlink() and os.path.isabs(os.readlink(p)) and p.exists() for p in shards)
    model = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, base(IDS).logits)


# 5. Corrupt input never yields a "successful" broken checkpoint ----------------------------------------------------
def write_safetensors(path: Path, header, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def minimal_checkpoint(folder: Path, header, data: bytes) -> Path:
    folder.mkdir(parents=True)
    config = tiny_base_model("llama").config.to_dict()
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", header, data)
    return folder


F32_2x2 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        (["not", "an", "object"], b"", "not a JSON object"),
        ({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, bytes(12), "needs 16"),
        ({"a": F32_2x2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16), "overlaps"),
        ({"a": F32_2x2, "b": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]}}, bytes(24), "gap"),
        ({"a": {"dtype": "F32", "shape": ["2", 2], "data_offsets": [0, 16]}}, bytes(16), "non-negative integers"),
        ({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(8), "runs past|describes 16"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1), "unsupported dtype"),
        ({"a": {"dtype": "F32", "shape": [2]}}, bytes(8), "data_offsets"),
    ],
)
def test_corrupt_headers_are_refused(tmp_path, capsys, header, data, message):
    folder = minimal_checkpoint(tmp_path / "bad", header, data)
    rc, err = cli(capsys, ["convert", str(folder), str(tmp_path / "out")])
    assert rc == 2 and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_a_tensor_in_two_shards_is_refused(src, tmp_path, capsys):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    (src / shards[1]).write_bytes((src / shards[0]).read_bytes())  # the second shard repeats the first's tensors
    rc, err = cli(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert rc == 2 and "stored twice" in err


@pytest.mark.parametrize("index", [[1, 2], {"metadata": {}}, {"weight_map": ["a"]}])
def test_a_malformed_index_is_refused(src, tmp_path, capsys, index):
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, err = cli(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert rc == 2 and "weight_map" in err


def test_a_shard_named_like_the_knocks_file_is_refused(src, tmp_path, capsys):
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    old = sorted(set(index["weight_map"].values()))[0]
    (src / old).rename(src / KNOCKS_FILE)
    index["weight_map"] = {k: KNOCKS_FILE if v == old else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    rc, err = cli(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert rc == 2 and KNOCKS_FILE in err


# 6. Races and signals ------------------------------------------------------------------------------------------
def test_a_dst_created_during_the_run_is_not_replaced(src, tmp_path, monkeypatch):
    import kha_hf.conversion.converter as convert_module

    dst = tmp_path / "out"
    original = convert_module.carry_over_files

    def meanwhile(*args):
        dst.mkdir()
        (dst / "config.json").write_text('{"someone": "else"}')
        return original(*args)

    monkeypatch.setattr(convert_module, "carry_over_files", meanwhile)
    with pytest.raises(KHAError, match="appeared while"):
        convert(src, dst, progress=False)
    assert json.loads((dst / "config.json").read_text()) == {"someone": "else"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out.", ".kha-"))]


def test_two_concurrent_converts_to_one_dst_one_fails(src, tmp_path):
    cmd = [sys.executable, "-m", "kha_hf", "convert", str(src), str(tmp_path / "out")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in (1, 2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    assert "already exists" in results[[rc for rc, _ in results].index(2)][1] or "appeared" in str(results)
    assert (tmp_path / "out" / "config.json").is_file()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signals_remove_the_temporary_folder(src, tmp_path, signame):
    script = textwrap.dedent(
        f"""
        import os, signal
        import kha_hf.conversion.converter as m
        from kha_hf.cli import main
        original, calls = m.place_file, []
        def place_then_signal(*args):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.{signame})
            return original(*args)
        m.place_file = place_then_signal
        raise SystemExit(main(["convert", {str(src)!r}, {str(tmp_path / "out")!r}]))
        """
    )
    # A shell starts background jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt handler:
    # start the child with the default disposition, as a terminal's foreground `kha convert` has it.
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert result.returncode == 130, result.stderr
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".out.", ".kha-"))], "temporary folder left behind"


def test_a_rerun_removes_stale_partials_it_owns_and_keeps_others(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    def partial(name: str, pid: int) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        record = {"destination": "out", "host": socket.gethostname(), "pid": pid, "state": "writing"}
        (folder / PARTIAL_MARKER).write_text(json.dumps(record))
        return folder

    stale, alive = partial(".kha-abc12345.partial", dead.pid), partial(".kha-def45678.partial", os.getpid())
    foreign = tmp_path / ".kha-ghi78901.partial"  # no marker: not kha's
    foreign.mkdir()
    old_style = tmp_path / ".out.jkl012.partial"  # kha-hf <= 0.2's name and marker: no longer kha's to remove
    old_style.mkdir()
    (old_style / PARTIAL_MARKER).write_text(f"{socket.gethostname()} {dead.pid}\n")
    with run_at_work_in(alive):  # its run holds the lock
        assert remove_stale_partials(tmp_path / "out") == [stale]
    assert old_style.exists()
    assert alive.exists() and foreign.exists() and not stale.exists()
