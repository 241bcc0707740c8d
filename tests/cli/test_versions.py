"""The supported transformers range: one place for the floor, a one-line refusal below it, one warning above the
newest tested release, and `kha --version`.

A transformers of another release is simulated by a `transformers-X.dist-info` folder put first on PYTHONPATH:
`importlib.metadata` answers with the first distribution of a name it finds, which is what kha-hf's check reads.
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from kha_hf.common import supported_versions
from kha_hf.common.supported_versions import (
    TRANSFORMERS_FLOOR,
    TRANSFORMERS_TESTED,
    UnsupportedTransformers,
    UntestedTransformersWarning,
    check_transformers,
)

ROOT = Path(__file__).resolve().parents[2]


def requirement(section: str, key: str, name: str) -> str:
    """The version specifier of NAME in setup.cfg's [SECTION] KEY (a list of requirement lines)."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    for line in parser[section][key].splitlines():
        line = line.split("#")[0].strip()
        match = re.fullmatch(rf"{re.escape(name)}(\[[\w,]+\])?\s*([<>=!~].*)?", line)
        if match:
            return (match.group(2) or "").strip()
    raise AssertionError(f"{name} is not in setup.cfg [{section}] {key}")


def test_the_floor_is_written_once_everywhere_it_is_needed():
    from kha_hf.modeling.configuration_kha import MIN_TRANSFORMERS

    assert requirement("options", "install_requires", "transformers") == f">={TRANSFORMERS_FLOOR}"
    assert MIN_TRANSFORMERS == TRANSFORMERS_FLOOR  # the remote code written into checkpoints runs from the floor
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert f'REMOTE_CODE_MIN_TRANSFORMERS="transformers=={TRANSFORMERS_FLOOR}"' in install  # CI's low end


def test_no_upper_bound_on_the_libraries_kha_hf_follows():
    for section, key, name in [
        ("options", "install_requires", "transformers"),
        ("options", "install_requires", "peft"),
        ("options", "install_requires", "accelerate"),
    ]:
        assert "<" not in requirement(section, key, name), f"{name} is capped in setup.cfg"


@pytest.mark.parametrize("version", ["5.16.1rc1", "5.16.1.dev0", "5.16rc1", "5.16.0.post1", "dev"])
def test_pre_releases_of_the_floor_are_below_it(version):
    with pytest.raises(UnsupportedTransformers):
        check_transformers(version)


def test_below_the_floor_is_one_line_naming_the_range():
    with pytest.raises(UnsupportedTransformers) as err:
        check_transformers("5.15.2")
    message = str(err.value)
    assert len(message.splitlines()) == 1
    assert f"transformers>={TRANSFORMERS_FLOOR}" in message and "5.15.2" in message


def test_above_the_newest_tested_release_warns_once_and_goes_on():
    major, minor = supported_versions.release(TRANSFORMERS_TESTED)[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_transformers(f"{major}.{minor}.7")  # a patch release of the tested minor: silent
        check_transformers(TRANSFORMERS_FLOOR)
        assert caught == []
        check_transformers(f"{major}.{minor + 1}.0")
    assert [type(w.message) for w in caught] == [UntestedTransformersWarning]
    assert f"{major}.{minor + 1}.0" in str(caught[0].message)


def fake_transformers(tmp_path: Path, version: str) -> dict:
    """An environment whose importlib.metadata reports transformers VERSION (a dist-info first on PYTHONPATH)."""
    info = tmp_path / "fake" / f"transformers-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    path = os.pathsep.join(filter(None, [str(tmp_path / "fake"), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def test_kha_refuses_an_old_transformers_in_one_line(tmp_path):
    env = fake_transformers(tmp_path, "5.10.0")
    cli = subprocess.run(
        [sys.executable, "-m", "kha_hf_entry", "convert", "a", "b"], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.strip().splitlines() == [
        f"kha: error: kha-hf supports transformers>={TRANSFORMERS_FLOOR} (tested up to {TRANSFORMERS_TESTED}); "
        f"installed: 5.10.0: pip install 'transformers>={TRANSFORMERS_FLOOR}'"
    ]
    imported = subprocess.run([sys.executable, "-c", "import kha_hf"], env=env, capture_output=True, text=True)
    assert imported.returncode == 1 and "UnsupportedTransformers" in imported.stderr


def test_a_newer_transformers_warns_once_at_import(tmp_path):
    major, minor = supported_versions.release(TRANSFORMERS_TESTED)[:2]
    env = fake_transformers(tmp_path, f"{major}.{minor + 3}.0")
    run = subprocess.run(
        [sys.executable, "-W", "default", "-c", "import kha_hf; print('imported')"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and run.stdout.strip() == "imported", run.stderr
    assert run.stderr.count("UntestedTransformersWarning") == 1


def test_kha_version_names_the_libraries_it_runs_on():
    from importlib.metadata import version  # the distributions' versions (torch's import name adds +cpu / +cu130)

    from kha_hf import __version__

    run = subprocess.run(
        [sys.executable, "-m", "kha_hf_entry", "--version"], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert run.stdout.strip() == (
        f"kha-hf {__version__} (transformers {version('transformers')}, torch {version('torch')}, "
        f"peft {version('peft')})"
    )


def test_kha_eval_on_an_lm_eval_below_its_floor_is_one_line(tmp_path):
    """lm-eval 0.4.11 (Axolotl 0.19's pin) lacks the task loader kha eval uses: a ModuleNotFoundError before."""
    info = tmp_path / "fake" / "lm_eval-0.4.11.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lm_eval\nVersion: 0.4.11\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), str(ROOT)])}
    code = (
        "from kha_hf.eval.compare import run_eval\n"
        "try:\n    run_eval('a', 'b')\nexcept Exception as err:\n    print(err)"
    )
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert run.stdout.strip() == ("kha eval needs lm_eval>=0.4.13, installed: 0.4.11: pip install 'lm_eval>=0.4.13'"), (
        run.stdout + run.stderr[-2000:]
    )


def test_kha_version_answers_under_an_old_transformers(tmp_path):
    """`kha --version` is what a user runs to see why kha refuses: it prints the versions, then the refusal."""
    from kha_hf.common.version import __version__

    env = fake_transformers(tmp_path, "5.10.0")
    cli = subprocess.run(
        [sys.executable, "-m", "kha_hf_entry", "--version"], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith(f"kha-hf {__version__} (transformers 5.10.0, torch ")
    assert cli.stderr.strip().splitlines() == [
        f"kha: warning: kha-hf supports transformers>={TRANSFORMERS_FLOOR} (tested up to {TRANSFORMERS_TESTED}); "
        f"installed: 5.10.0: pip install 'transformers>={TRANSFORMERS_FLOOR}'"
    ]
