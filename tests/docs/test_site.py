"""The docs site builds with `mkdocs build --strict`, offline, and a broken link or anchor, a page missing from the
nav and a stale CLI flag each fail the build, naming the page (and the line, where there is one)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT

pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') is not installed")
pytest.importorskip("material", reason="the docs extra (pip install -e '.[docs]') is not installed")
pytest.importorskip("mkdocstrings", reason="the docs extra (pip install -e '.[docs]') is not installed")

SITE_FILES = ["mkdocs.yml", "docs", "CHANGELOG.md", "kha_hf", "kha_hf_entry.py"]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "NO_MKDOCS_2_WARNING": "1",
        "HF_HUB_OFFLINE": "1",
        # offline: any request the build made would fail here instead of waiting on the network
        "HTTP_PROXY": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "",
    }
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = build(ROOT, out)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "WARNING" not in result.stderr, result.stderr[-5000:]
    return out


def copy_of_the_docs(tmp_path: Path) -> Path:
    """mkdocs.yml, docs/ and the changelog copied; the package linked, so the references still build."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in SITE_FILES:
        src = ROOT / name
        if name in ("kha_hf", "kha_hf_entry.py"):
            (root / name).symlink_to(src)
        elif src.is_dir():
            shutil.copytree(src, root / name)
        else:
            shutil.copy(src, root / name)
    return root


def test_the_site_builds_strictly_offline(site):
    assert (site / "index.html").exists()
    for page in ["getting-started", "guides/convert", "guides/peft", "does-kha-help", "reference/cli", "changelog"]:
        assert (site / page / "index.html").exists(), page
    # nothing a page loads comes from the network (web fonts, scripts, styles): the site renders offline too
    remote = re.compile(r'(?:src|href)="(https?://[^"]+\.(?:js|css|woff2?|ttf)(?:\?[^"]*)?)"')
    loaded = {url for page in site.rglob("*.html") for url in remote.findall(page.read_text())}
    assert loaded == set()
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()


def test_every_guide_starts_with_a_command(site):
    guides = sorted((ROOT / "docs" / "guides").glob("*.md"))
    late = []
    for guide in guides:
        lines = guide.read_text().splitlines()
        first_fence = next((i for i, line in enumerate(lines) if line.startswith("```")), None)
        if first_fence is None or first_fence > 8:
            late.append(guide.name)
    assert late == [], f"guides whose first block is not at their top: {late}"


def test_the_cli_reference_has_every_command_and_flag(site):
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    html = (site / "reference" / "cli" / "index.html").read_text()
    parser = hooks.cli_parser()
    for name, sub in hooks.subcommands(parser).items():
        assert f'id="kha-{name}"' in html, name
        for flag in hooks.flags(sub):
            assert flag in html, (name, flag)


def test_the_api_reference_has_every_public_name(site):
    import kha_hf

    html = (site / "reference" / "api" / "index.html").read_text()
    ids = set(re.findall(r'id="([^"]+)"', html))
    missing = [name for name in kha_hf.__all__ if not any(i == name or i.endswith("." + name) for i in ids)]
    assert missing == []


def test_the_changelog_page_is_the_changelog(site):
    html = (site / "changelog" / "index.html").read_text()
    newest = re.search(r"^## \[([\d.]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert newest in html
    from kha_hf import __version__

    assert newest == __version__, "CHANGELOG.md's newest release is the package's version"


def test_bad_input_fails_the_build_with_page_and_line(tmp_path):
    root = copy_of_the_docs(tmp_path)
    guide = root / "docs" / "guides" / "train.md"
    lines = guide.read_text().splitlines()
    n = len(lines)
    lines += [
        "",
        "See [a page that is not there](no-such-page.md) and [a heading that is not there](../safety.md#no-such).",
        "",
        "<!-- not-run: a stale flag, on purpose -->",
        "```bash",
        "kha train ./model --output ./out --no-such-flag 3",
        "```",
    ]
    guide.write_text("\n".join(lines) + "\n")
    (root / "docs" / "orphan.md").write_text("# Not in the nav\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0
    err = result.stderr
    assert f"guides/train.md:{n + 2}: the link no-such-page.md" in err, err[-3000:]
    assert f"guides/train.md:{n + 2}: the link's anchor #no-such" in err, err[-3000:]
    assert f"guides/train.md:{n + 6}: `kha train` has no flag --no-such-flag" in err, err[-3000:]
    assert "orphan.md" in err, err[-3000:]


def test_a_nav_entry_without_its_page_fails_the_build(tmp_path):
    root = copy_of_the_docs(tmp_path)
    (root / "docs" / "guides" / "gguf.md").unlink()
    result = build(root, tmp_path / "site")
    assert result.returncode != 0
    assert "guides/gguf.md" in result.stderr, result.stderr[-3000:]
