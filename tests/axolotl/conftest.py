"""Axolotl's environment: `.venv-axolotl` (`bash scripts/install.sh axolotl`; scripts/test-axolotl.sh runs this
folder there). Axolotl 0.19 pins transformers 5.16.1 and peft 0.20.0, so it is an environment of its own, and these
tests drive Axolotl in-process, through its own API (`prepare_plugins` before `validate_config`, as `axolotl train`
does). Elsewhere (kha-hf's main environment) they skip, naming the command that makes it; with KHA_REQUIRE_AXOLOTL=1
(CI, in that environment) they fail instead."""

from __future__ import annotations

import os
from importlib import metadata

import pytest

# Axolotl's telemetry would post to the network at import and after each run; offline here, and not ours to send
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")
MISSING = (
    "axolotl is not installed in this environment; create it with: bash scripts/install.sh axolotl, then run "
    "scripts/test-axolotl.sh"
)


@pytest.fixture(scope="session", autouse=True)
def axolotl_installed():
    """Skip (or, with KHA_REQUIRE_AXOLOTL=1, fail) without Axolotl, before any other fixture of this folder runs."""
    # the installed distribution, not an importable name: from the repository root this very folder, tests/axolotl,
    # is an importable namespace package called `axolotl`
    try:
        metadata.version("axolotl")
    except metadata.PackageNotFoundError:
        if os.environ.get("KHA_REQUIRE_AXOLOTL") == "1":
            pytest.fail(MISSING)
        pytest.skip(MISSING)


@pytest.fixture(autouse=True)
def axolotl_environment(axolotl_installed):
    """Clear Axolotl's PluginManager singleton around each test, so no plugin or config of one test is seen by the
    next."""
    from tests.axolotl.runner import clear_plugins

    clear_plugins()
    yield
    clear_plugins()


@pytest.fixture(scope="session")
def knock_run(tmp_path_factory, axolotl_installed):
    """A linear_qkv knock adapter trained by Axolotl on a tiny stock Llama (8 steps): the run's folder, its base,
    the trained model in memory (eval mode) and its losses; shared by the reload, convert and merge tests."""
    from tests.axolotl.runner import clear_plugins, config, losses, train
    from tests.helpers import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("knock_run")
    save_tiny_checkpoint(root / "base", "llama")
    clear_plugins()
    cfg = config(root, root / "base", adapter="knock", knock={"preset": "linear_qkv"}, max_steps=8)
    model, trainer, _ = train(cfg)
    clear_plugins()
    return {
        "root": root,
        "base": root / "base",
        "out": root / "out",
        "cfg": cfg,
        "model": model.eval(),
        "losses": losses(trainer),
    }
