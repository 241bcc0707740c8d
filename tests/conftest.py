"""Shared test setup: offline hub, a temporary HF_HOME, tiny configs of every base family, one parity helper."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    # Marks used by transformers' own test_modeling_common.py (tests/modeling/upstream_common.py loads it).
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' own tests")


@pytest.fixture(autouse=True)
def _isolated_hf_home(tmp_path_factory, monkeypatch):
    # Remote code is cached by hash under HF_HOME/modules: keep each test session's cache private.
    home = tmp_path_factory.getbasetemp() / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_MODULES_CACHE", str(home / "modules"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
