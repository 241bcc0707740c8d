"""Shared test setup: offline hub, a temporary HF_HOME, tiny configs of every base family, one parity helper."""

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

_INDUCTOR_CACHE: str | None = None  # the session's own torch compile cache, if it made one


def pytest_configure(config):
    # Under pytest-xdist (README: `-n 2`) the workers share the machine's cores: torch's default of one thread per
    # core in every worker would put several threads on each core. Each worker gets its share instead, and so do the
    # processes its tests start (OMP_NUM_THREADS, which torch reads at start): a float32 result compared bit for bit
    # across processes (remote code in a fresh interpreter) depends on the number of threads that summed it.
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    # Marks used by transformers' own test_modeling_common.py (tests/modeling/upstream_common.py loads it).
    config.addinivalue_line("markers", f"exhaustive: {EXHAUSTIVE_NOTE}")
    # `--dist loadscope` hands out whole modules; pytest-xdist (3.8) orders them by their number of tests unless told
    # not to, which put the long training and vLLM modules (few tests, many minutes) last: one worker ran alone for
    # their last 10 minutes. Collection order instead, the longest modules first (pytest_collection_modifyitems).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    for mark in ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test"):
        config.addinivalue_line("markers", f"{mark}: a mark of transformers' own tests")
    # Importing a transformers model class (torch 2.13) creates torch's compile cache, TMPDIR/torchinductor_<user>,
    # while tests are collected, before any fixture runs, and every compile of the session then writes there: it
    # outlived the run in /tmp. The session gets its own, removed when it ends (unless the caller chose one).
    global _INDUCTOR_CACHE
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        _INDUCTOR_CACHE = tempfile.mkdtemp(prefix="kha-tests-torchinductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE


# The contributor's fast tier is `pytest -m "not slow"` (README): these modules and tests are marked slow as a whole,
# besides the real-model tests marked in their files. They are what the durations of a full run put first: real
# models, transformers' own common tests, vLLM and llama.cpp environments, servers, training runs and A/Bs,
# subprocesses that start a fresh interpreter (remote code, distributed runs), benchmarks. CI runs them all.
SLOW_PATHS = (
    "tests/benchmarks/",
    "tests/vllm/",
    "tests/gguf/",
    "tests/workflows/",
    "tests/serving/",
    "tests/training/",
    "tests/modeling/test_transformers_common.py",
    "tests/modeling/test_multimodal_common.py",
    "tests/modeling/test_engine_readiness.py",
    "tests/modeling/test_backends.py",
    "tests/modeling/test_remote_code.py",
    "tests/modeling/test_old_checkpoints.py",
    "tests/modeling/test_pipeline.py",
    "tests/cli/test_bad_input_eval_backend.py",
    "tests/cli/test_file_size_limit_round5.py",
    "tests/peft/test_eval_adapter.py",
    "tests/peft/test_trl.py",
    "tests/peft/test_peft_upstream.py",
    "tests/eval/test_eval.py",
)
# The exhaustive tier: matrix points that repeat, on more families or engines, a code path that CI already runs on a
# representative one (each marked where it is defined, saying which one). They skip unless KHA_EXHAUSTIVE=1, which
# runs every family and engine of the table (docs/getting-started.md: before a release, and after a change to the code
# they cover). CI runs the representatives: .ci/run has a 45-minute target on 2 cores.
EXHAUSTIVE = os.environ.get("KHA_EXHAUSTIVE") == "1"
EXHAUSTIVE_NOTE = "a matrix point that CI covers on a representative; runs with KHA_EXHAUSTIVE=1"
SLOW_NAMES = ("remote_code", "fresh_process", "without_kha_hf", "permutation_test_memory", "unreachable_hub")


# The longest modules first. `--dist loadscope` gives each worker whole modules in collection order (pytest_configure
# turns off xdist's reordering by test count), so a long module collected last ran alone at the end while the other
# worker sat idle (test_resume_exact.py: about 10 minutes on 2026-12-07). Worker-seconds measured on 2026-12-07,
# longest first; the rest keep their order.
LONGEST_FIRST = (
    "tests/training/test_resume_exact.py",
    "tests/vllm/test_vllm_backend.py",
    "tests/vllm/test_vllm_plugin.py",
    "tests/vllm/test_vllm_families.py",
    "tests/vllm/test_vllm_eval.py",
    "tests/benchmarks/test_benchmarks.py",
    "tests/workflows/test_every_family_cli.py",
    "tests/training/test_parallel_layouts.py",
    "tests/training/test_continued_ab.py",
    "tests/docs/test_snippets.py",
    "tests/training/test_prepared_corpus.py",
    "tests/vllm/test_vllm_server.py",
    "tests/peft/test_peft_upstream.py",
    "tests/gguf/test_real_models.py",
    "tests/eval/test_eval.py",
    "tests/vllm/test_vllm_multimodal.py",
)


def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    paths = {id(item): Path(str(item.path)).resolve().relative_to(root).as_posix() for item in items}
    items.sort(key=lambda item: rank.get(paths[id(item)], len(LONGEST_FIRST)))  # stable: the rest keep their order
    for item in items:
        where = Path(str(item.path)).resolve().relative_to(root).as_posix()
        if where.startswith(SLOW_PATHS) or any(name in item.name for name in SLOW_NAMES):
            item.add_marker(pytest.mark.slow)
        if not EXHAUSTIVE and item.get_closest_marker("exhaustive") is not None:
            item.add_marker(pytest.mark.skip(reason=EXHAUSTIVE_NOTE))


def pytest_unconfigure(config):
    if _INDUCTOR_CACHE is not None:
        shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


@pytest.fixture(autouse=True)
def _isolated_hf_home(tmp_path_factory, monkeypatch):
    # Remote code is cached by hash under HF_HOME/modules: keep each test session's cache private.
    home = tmp_path_factory.getbasetemp() / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_MODULES_CACHE", str(home / "modules"))


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_in_pytest_s_folder(tmp_path_factory):
    # What tests start writes temporary files under TMPDIR and leaves some: vLLM 0.32 its IPC sockets
    # (/tmp/<uuid>, about 100 a run), torch's launcher an empty torchelastic_* folder. Point TMPDIR (and
    # `tempfile`) into pytest's base folder, which pytest removes after a passing run (pyproject.toml). Session
    # scope: session fixtures that start servers copy the environment before any test runs.
    folder = tmp_path_factory.getbasetemp() / "tmp"
    folder.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        patch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again; restored after the session
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def gemma3_linear_kha(tmp_path_factory):
    """Gemma 3 270M (the real GGUF from PyPI, 262k vocabulary) converted once per test run to linear_qkv with
    --verify; returns (folder, what verify printed). Reading this GGUF takes about a minute: tests that need another
    preset derive it from this folder (streaming), never from the GGUF again."""
    import contextlib
    import io

    from kha_hf.common.assets import gemma3_gguf
    from kha_hf.conversion import convert
    from tests.helpers import made_once

    def make(root):
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            convert(gemma3_gguf(), root / "linear_qkv", knock="linear_qkv", verify=True, progress=False)
        (root / "verify.txt").write_text(report.getvalue())

    root = made_once(tmp_path_factory, "gemma3", make)
    return root / "linear_qkv", (root / "verify.txt").read_text()
