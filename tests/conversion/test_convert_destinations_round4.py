"""Issue #28, destinations and writes, for `kha convert` / `kha fold` / `kha inspect --plot` (round 4).

Each test reproduces a case found as a careless user or a malicious checkpoint author: `--overwrite` of a folder
that merely looks like a checkpoint, symbolic links out of a source, DST inside SRC (also through a link), a plot
written through a link or over a file unasked, a 250-character DST name, a SIGTERM just after the swap, and stale
temporary folders found by their marker rather than by their name.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kha_hf import KHAForCausalLM, __version__
from kha_hf.checkpoint.output import PARTIAL_MARKER, remove_stale_partials, resumable_partials
from kha_hf.checkpoint.paths import OUTPUT_MARKER
from kha_hf.common.errors import KHAError
from kha_hf.conversion import convert
from tests.conversion.test_convert import make_checkpoint, sha256_tree
from tests.conversion.test_safety import cli
from tests.helpers import run_at_work_in, tiny_base_model


def _tree(folder: Path) -> dict[str, str]:
    return sha256_tree(folder) if folder.exists() else {}


def leftovers(folder: Path) -> list[str]:
    """Temporary folders or files of kha left in FOLDER (new `.kha-*` names and the old `.NAME.*.partial` ones)."""
    return [p.name for p in folder.iterdir() if p.name.startswith(".kha-") or p.name.endswith(".partial")]


@pytest.fixture
def src(tmp_path) -> Path:
    folder = tmp_path / "p" / "src"
    make_checkpoint(folder)
    return folder


@pytest.fixture
def linear_kha(tmp_path) -> Path:
    folder = tmp_path / "kha"
    KHAForCausalLM.from_base(tiny_base_model("llama"), knock="linear_qkv").save_pretrained(folder)
    return folder


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# Medium 5: --overwrite replaces only a folder kha wrote ----------------------------------------------------------
def test_overwrite_refuses_a_web_app_with_a_config_json(src, tmp_path, capsys):
    app = tmp_path / "myapp"
    (app / "src").mkdir(parents=True)
    (app / "config.json").write_text('{"name": "app"}')
    (app / "src" / "main.py").write_text("print('hello')\n")
    before = _tree(app)
    rc, err = cli(capsys, ["convert", str(src), str(app), "--overwrite"])
    assert rc == 2 and "does not look like a folder kha wrote" in err and "delete it yourself" in err
    assert _tree(app) == before


def test_overwrite_refuses_a_folder_that_looks_like_a_training_run(src, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint-1").mkdir(parents=True)
    (run / "checkpoint-1" / "trainer_state.json").write_text("{}")
    (run / "notes.txt").write_text("mine")
    before = _tree(run)
    rc, err = cli(capsys, ["convert", str(src), str(run), "--overwrite"])
    assert rc == 2 and OUTPUT_MARKER in err
    assert _tree(run) == before


def test_a_marker_that_is_a_link_is_no_licence(src, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "real-marker").write_text("{}")
    (folder / OUTPUT_MARKER).symlink_to(tmp_path / "real-marker")
    (folder / "keep.txt").write_text("mine")
    rc, err = cli(capsys, ["convert", str(src), str(folder), "--overwrite"])
    assert rc == 2 and "does not look like a folder kha wrote" in err
    assert (folder / "keep.txt").read_text() == "mine"


def test_convert_and_fold_outputs_carry_the_marker_and_overwrite_replaces_them(src, linear_kha, tmp_path, capsys):
    out = convert(src, tmp_path / "out", progress=False).output
    assert json.loads((out / OUTPUT_MARKER).read_text()) == {"command": "kha convert", "version": __version__}
    assert not (out / PARTIAL_MARKER).exists()
    (out / "stale.txt").write_text("from the first run")
    assert cli(capsys, ["convert", str(src), str(out), "--overwrite"])[0] == 0
    assert not (out / "stale.txt").exists() and (out / OUTPUT_MARKER).is_file()
    folded = tmp_path / "folded"
    assert cli(capsys, ["fold", str(linear_kha), str(folded)])[0] == 0
    assert json.loads((folded / OUTPUT_MARKER).read_text()) == {"command": "kha fold", "version": __version__}
    assert cli(capsys, ["fold", str(linear_kha), str(folded), "--overwrite"])[0] == 0
    assert leftovers(tmp_path) == []


def test_push_leaves_kha_s_markers_out(tmp_path, monkeypatch):
    import huggingface_hub

    from kha_hf.conversion.hub import push_folder

    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, *args, **kwargs):
            pass

        def upload_folder(self, **kwargs):
            calls.update(kwargs)
            return "url"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    push_folder(folder, "me/m")
    assert OUTPUT_MARKER in calls["ignore_patterns"] and PARTIAL_MARKER in calls["ignore_patterns"]


# Medium 6: symbolic links in a source are not followed out of it ---------------------------------------------------
@pytest.mark.parametrize("name", ["LICENSE", "README.md", "tokenizer_config.json"])
def test_convert_refuses_a_link_out_of_the_source(src, tmp_path, capsys, name):
    secret = tmp_path / "p" / "secret.txt"
    secret.write_text("the password is hunter2")
    target = src / name
    if target.exists():
        target.unlink()
    target.symlink_to(Path("..") / "secret.txt")
    rc, err = cli(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert rc == 2 and name in err and "outside the source" in err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_convert_refuses_a_shard_linked_out_of_the_source(src, tmp_path, capsys):
    shard = sorted(src.glob("model-*.safetensors"))[0]
    elsewhere = tmp_path / "elsewhere.safetensors"
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere)
    rc, err = cli(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert rc == 2 and shard.name in err and "outside the source" in err
    assert not (tmp_path / "out").exists()


def test_a_link_inside_the_source_is_copied_as_a_file(src, tmp_path):
    (src / "LICENSE.real").write_text("MIT")
    (src / "LICENSE").unlink(missing_ok=True)
    (src / "LICENSE").symlink_to("LICENSE.real")
    out = convert(src, tmp_path / "out", progress=False).output
    assert (out / "LICENSE").read_text() == "MIT" and not (out / "LICENSE").is_symlink()


def test_fold_refuses_a_link_out_of_the_source(linear_kha, tmp_path, capsys):
    (tmp_path / "secret.txt").write_text("the password is hunter2")
    (linear_kha / "LICENSE").symlink_to(tmp_path / "secret.txt")
    rc, err = cli(capsys, ["fold", str(linear_kha), str(tmp_path / "folded")])
    assert rc == 2 and "LICENSE" in err and "outside the source" in err
    assert not (tmp_path / "folded").exists()


# Low: DST inside SRC -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("via_link", [False, True])
def test_convert_refuses_a_destination_inside_the_source(src, tmp_path, capsys, via_link):
    before = _tree(src)
    parent = src
    if via_link:
        (tmp_path / "link").symlink_to(src)
        parent = tmp_path / "link"
    rc, err = cli(capsys, ["convert", str(src), str(parent / "out")])
    assert rc == 2 and "inside the source" in err
    assert _tree(src) == before and not (src / "out").exists()


@pytest.mark.parametrize("via_link", [False, True])
def test_fold_refuses_a_destination_inside_the_source(linear_kha, tmp_path, capsys, via_link):
    before = _tree(linear_kha)
    parent = linear_kha
    if via_link:
        (tmp_path / "link").symlink_to(linear_kha)
        parent = tmp_path / "link"
    rc, err = cli(capsys, ["fold", str(linear_kha), str(parent / "sub" / "folded")])
    assert rc == 2 and "inside the source" in err
    assert _tree(linear_kha) == before


# Low: a valid 250-character DST name -----------------------------------------------------------------------------
def test_a_250_character_destination_name_works(src, tmp_path):
    name = "m" * 250
    out = convert(src, tmp_path / name, progress=False).output
    assert out.name == name and (out / "config.json").is_file()
    assert leftovers(tmp_path) == []


# Medium 8: the swap is the commit point ----------------------------------------------------------------------------
def test_sigterm_just_after_the_swap_is_a_success(src, tmp_path):
    out = tmp_path / "out"
    convert(src, out, progress=False)
    (out / "old.txt").write_text("the previous output")
    script = textwrap.dedent(
        f"""
        import os, signal
        import kha_hf.checkpoint.output as o
        from kha_hf.cli import main
        original = o.exchange
        def exchange_then_die(a, b):
            original(a, b)
            os.kill(os.getpid(), signal.SIGTERM)  # the new output is in place; the old one is not removed yet
        o.exchange = exchange_then_die
        raise SystemExit(main(["convert", {str(src)!r}, {str(out)!r}, "--overwrite"]))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SIGTERM" in result.stderr and "completed" in result.stderr
    assert not (out / "old.txt").exists() and (out / "config.json").is_file()
    assert not (out / PARTIAL_MARKER).exists()
    assert leftovers(tmp_path) == []


# Temporary folders are found by their marker, not by their name ------------------------------------------------
def _partial(folder: Path, destination: str, pid: int, state: str = "writing", checkpoints: bool = False) -> Path:
    folder.mkdir()
    record = {"destination": destination, "host": socket.gethostname(), "pid": pid, "start": None, "state": state}
    (folder / PARTIAL_MARKER).write_text(json.dumps(record))
    if checkpoints:
        (folder / "checkpoint-2").mkdir()
        (folder / "checkpoint-2" / "trainer_state.json").write_text("{}")
    return folder


def test_stale_partials_are_found_by_their_marker(tmp_path):
    dead = dead_pid()
    stale = _partial(tmp_path / ".kha-aaaa.partial", "out", dead)
    other = _partial(tmp_path / ".kha-bbbb.partial", "other", dead)
    alive = _partial(tmp_path / ".kha-cccc.partial", "out", os.getpid())
    kept = _partial(tmp_path / ".kha-dddd.partial", "out", dead, checkpoints=True)
    old = _partial(tmp_path / ".kha-eeee.partial", "out", dead, state="old", checkpoints=True)
    foreign = tmp_path / ".kha-ffff.partial"
    foreign.mkdir()
    with run_at_work_in(alive):  # its run holds the lock: whatever the marker says, it works there
        assert sorted(remove_stale_partials(tmp_path / "out")) == sorted([stale, old])
        assert other.exists() and alive.exists() and kept.exists() and foreign.exists()
        assert resumable_partials(tmp_path / "out") == [kept]


def test_a_partial_that_is_a_link_is_never_removed_nor_adopted(tmp_path):
    dead = dead_pid()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "checkpoint-2").mkdir()
    (target / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (target / PARTIAL_MARKER).write_text(f"{socket.gethostname()} {dead}\nresumable\n")  # kha-hf 0.2's marker
    (target / "precious.txt").write_text("keep")
    (tmp_path / ".out.legacy1.partial").symlink_to(target)  # the name kha-hf 0.2 gave its partials
    (tmp_path / ".kha-link.partial").symlink_to(target)
    assert resumable_partials(tmp_path / "out") == []
    assert remove_stale_partials(tmp_path / "out") == []
    (target / "checkpoint-2" / "trainer_state.json").unlink()  # no checkpoints: what a stale partial looks like
    assert remove_stale_partials(tmp_path / "out") == []
    assert (target / "precious.txt").read_text() == "keep"


def test_a_marker_that_is_a_link_is_ignored(tmp_path):
    dead = dead_pid()
    (tmp_path / "fake-marker").write_text(f"{socket.gethostname()} {dead}\n")
    for name in (".out.zzzz.partial", ".kha-zzzz.partial"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / PARTIAL_MARKER).symlink_to(tmp_path / "fake-marker")
        (folder / "mine.txt").write_text("keep")
    assert remove_stale_partials(tmp_path / "out") == []
    assert (tmp_path / ".out.zzzz.partial" / "mine.txt").exists()
    assert (tmp_path / ".kha-zzzz.partial" / "mine.txt").exists()


def test_a_partial_locked_by_a_running_process_is_neither_adopted_nor_removed(tmp_path):
    """Two `--resume` runs never continue one folder: the run working in it holds a lock, whatever its marker says
    (here a dead process id, as after a process id is reused)."""
    import fcntl

    dead = dead_pid()
    kept = _partial(tmp_path / ".kha-kept.partial", "out", dead, state="resumable", checkpoints=True)
    stale = _partial(tmp_path / ".kha-stale.partial", "out", dead)
    fds = [os.open(folder, os.O_RDONLY) for folder in (kept, stale)]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert resumable_partials(tmp_path / "out") == []
        assert remove_stale_partials(tmp_path / "out") == [] and stale.exists()
    finally:
        for fd in fds:
            os.close(fd)
    assert resumable_partials(tmp_path / "out") == [kept]
    assert remove_stale_partials(tmp_path / "out") == [stale]


# Low: kha inspect --plot ---------------------------------------------------------------------------------------------
@pytest.fixture
def mlp_kha(tmp_path) -> Path:
    folder = tmp_path / "mlp"
    KHAForCausalLM.from_base(tiny_base_model("llama"), knock="mlp_v").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("overwrite", [False, True])
def test_inspect_plot_never_writes_through_a_link(mlp_kha, tmp_path, capsys, overwrite):
    config = (mlp_kha / "config.json").read_bytes()
    (tmp_path / "evil.png").symlink_to(mlp_kha / "config.json")
    rc, err = cli(capsys, ["inspect", str(mlp_kha), "--plot", str(tmp_path / "evil.png")] + ["--overwrite"] * overwrite)
    assert rc == 2 and "symbolic link" in err
    assert (mlp_kha / "config.json").read_bytes() == config
    assert (tmp_path / "evil.png").is_symlink()


def test_inspect_plot_replaces_a_file_only_with_overwrite(mlp_kha, tmp_path, capsys):
    png = tmp_path / "holiday.png"
    png.write_bytes(b"\x89PNG my holiday")
    rc, err = cli(capsys, ["inspect", str(mlp_kha), "--plot", str(png)])
    assert rc == 2 and "already exists" in err and "--overwrite" in err
    assert png.read_bytes() == b"\x89PNG my holiday"
    rc, _ = cli(capsys, ["inspect", str(mlp_kha), "--plot", str(png), "--overwrite"])
    assert rc == 0 and png.read_bytes().startswith(b"\x89PNG\r\n") and png.stat().st_size > 1000
    fresh = tmp_path / "fresh.png"
    assert cli(capsys, ["inspect", str(mlp_kha), "--plot", str(fresh)])[0] == 0 and fresh.is_file()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_inspect_plot_never_writes_inside_the_model_it_reads(mlp_kha, tmp_path, capsys, monkeypatch, overwrite):
    monkeypatch.chdir(tmp_path)
    (mlp_kha / "old.png").write_bytes(b"old")
    plots = [mlp_kha / "new.png", Path("..") / tmp_path.name / mlp_kha.name / "new.png"]
    for plot in plots + [mlp_kha / "old.png"] * overwrite:  # without --overwrite, old.png is refused as existing
        rc, err = cli(capsys, ["inspect", str(mlp_kha), "--plot", str(plot)] + ["--overwrite"] * overwrite)
        assert rc == 2 and "inside the source" in err
    assert not (mlp_kha / "new.png").exists() and (mlp_kha / "old.png").read_bytes() == b"old"


def test_inspect_plot_refuses_a_folder(mlp_kha, tmp_path, capsys):
    (tmp_path / "dir.png").mkdir()
    rc, err = cli(capsys, ["inspect", str(mlp_kha), "--plot", str(tmp_path / "dir.png"), "--overwrite"])
    assert rc == 2 and "not a file" in err


def test_api_convert_error_names_the_marker(src, tmp_path):
    dst = tmp_path / "plain"
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    with pytest.raises(KHAError, match="no .kha-output marker"):
        convert(src, dst, overwrite=True, progress=False)


def test_convert_to_a_gguf_name_is_refused_in_one_line(src, tmp_path, capsys):
    """It wrote a folder named `out.gguf` without a word (round 7's attack)."""
    rc, err = cli(capsys, ["convert", str(src), str(tmp_path / "out.gguf")])
    assert rc == 2 and "kha convert writes a checkpoint folder, not a GGUF file" in err and "kha fold" in err
    assert not (tmp_path / "out.gguf").exists()
