"""Safety round 4 (issue 28): no silent bad result, CLI values bounded before anything is allocated, hostile
configs and files in one line.

Each case runs the real `kha` command (`kha_hf.cli.main`) on tiny 2-layer checkpoints and asserts the one-line
error, exit 2 and, where files are involved, that nothing was written.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kha_hf.cli import main
from kha_hf.common.errors import KHAError
from tests.cli.test_bad_input import one_line_error
from tests.helpers import save_tiny_checkpoint

TEXT = "the quick brown fox jumps over the lazy dog. " * 6  # 60 blocks of 4 tokens with the tiny tokenizer
SMALL = ["--seq-len", "4", "--batch-size", "2"]


@pytest.fixture
def kha(tmp_path) -> Path:
    save_tiny_checkpoint(tmp_path / "kha", knock="mlp_v", num_hidden_layers=2)
    return tmp_path / "kha"


@pytest.fixture
def base(tmp_path) -> Path:
    save_tiny_checkpoint(tmp_path / "base", num_hidden_layers=2)
    return tmp_path / "base"


@pytest.fixture
def text(tmp_path) -> Path:
    (tmp_path / "text.txt").write_text(TEXT)
    return tmp_path / "text.txt"


def train_error(capsys, argv) -> str:
    """The one error line of a `kha train` that prints progress before failing (exit 2)."""
    capsys.readouterr()
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("kha train: error: "), errors
    return errors[0]


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def never_loads(monkeypatch) -> None:
    """Fail the test if a model is built (a check that must come first did not)."""
    import kha_hf.training.train as train_module

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(train_module.KHAForCausalLM, "from_pretrained", refuse)


# --- no silent bad result -------------------------------------------------------------------------------------------
def test_a_diverged_run_exits_nonzero_and_saves_no_model(kha, text, tmp_path, capsys):
    argv = ["train", str(kha), "--output", str(tmp_path / "o"), "--data", str(text), *SMALL, "--lr", "1e30"]
    err = train_error(capsys, [*argv, "--max-steps", "4", "--save-steps", "1"])
    assert "training diverged" in err and "nan" in err and "not saved" in err
    assert not (tmp_path / "o").exists()
    kept = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]  # checkpoints kept for inspection
    assert kept and any(p.name.startswith("checkpoint-") for p in kept[0].iterdir())


def test_a_run_diverged_before_its_first_checkpoint_leaves_nothing(kha, text, tmp_path, capsys):
    """docs/safety.md (#70 item 16): the partial is kept only when it holds a checkpoint saved before the loss
    diverged; one without any would hold nothing to resume or inspect."""
    argv = ["train", str(kha), "--output", str(tmp_path / "o"), "--data", str(text), *SMALL, "--lr", "1e30"]
    err = train_error(capsys, [*argv, "--max-steps", "4", "--save-steps", "4"])
    assert "training diverged" in err and "not saved" in err
    assert not (tmp_path / "o").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".kha-")]


def test_the_result_check_names_the_nan_knocks():
    from kha_hf.training.guards import check_training_result

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_knock = torch.nn.Linear(2, 2)

    model = Model()
    check_training_result(3, 1.0, 1.0, model)  # finite: fine
    with torch.no_grad():
        model.q_knock.weight[0, 0] = float("inf")
    with pytest.raises(KHAError, match="knock tensors hold NaN"):
        check_training_result(3, 1.0, 1.0, model)
    with pytest.raises(KHAError, match="held-out loss nan"):
        check_training_result(3, 1.0, float("nan"), Model())
    with pytest.raises(KHAError, match="0 steps"):
        check_training_result(0, 0.0, 1.0, Model())


def test_fewer_blocks_than_a_batch_is_an_error_before_the_model_loads(kha, text, tmp_path, capsys, monkeypatch):
    never_loads(monkeypatch)
    argv = ["train", str(kha), "--output", str(tmp_path / "o"), "--data", str(text), "--seq-len", "4"]
    err = one_line_error(capsys, [*argv, "--batch-size", "1000"], "train")
    assert "fewer than one batch of 1000" in err and "nothing would train" in err
    assert not (tmp_path / "o").exists()


def test_an_empty_data_list_is_an_error_not_shakespeare(kha, tmp_path, capsys, monkeypatch):
    never_loads(monkeypatch)
    err = one_line_error(capsys, ["train", str(kha), "--output", str(tmp_path / "o"), "--data"], "train")
    assert "--data was given no file" in err
    err = one_line_error(capsys, ["ab", "--output", str(tmp_path / "ab"), "--data"], "ab")
    assert "--data was given no file" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "ab").exists()


def test_inspect_refuses_nan_knocks(kha, tmp_path, capsys):
    weights = load_file(kha / "model.safetensors")
    name = next(k for k in weights if "v_knock" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, kha / "model.safetensors", metadata={"format": "pt"})
    for extra in ([], ["--json"]):
        err = one_line_error(capsys, ["inspect", str(kha), *extra], "inspect")
        assert "NaN or infinite" in err and name in err
    assert capsys.readouterr().out == ""  # no table, no invalid JSON


def test_verify_refuses_nan_logits_instead_of_reporting_zero():
    from kha_hf.conversion.verify import compare_models

    class Out:
        def __init__(self, logits):
            self.logits = logits

    class Model(torch.nn.Module):
        def __init__(self, value):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))
            self.value = value

        def forward(self, ids):
            return Out(torch.full((1, ids.shape[1], 4), self.value))

    class Tok:
        eos_token_id = 0

        def __call__(self, text, return_tensors=None):
            return type("T", (), {"input_ids": torch.tensor([[1, 2]])})()

    with pytest.raises(KHAError, match="NaN or infinite logits"):
        compare_models(Model(float("nan")), Model(float("nan")), Tok(), prompts=("x",))


# --- --recompute -----------------------------------------------------------------------------------------------------
RECORD = {"task": "arc_easy", "metric": "acc", "subtask": "arc_easy", "doc_id": 0, "doc_hash": "h"}


def write_eval_folder(folder: Path, lines: list[str], summary: str | None) -> Path:
    folder.mkdir()
    (folder / "per_document.jsonl").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (folder / "summary.json").write_text(summary)
    return folder


def good_lines() -> list[str]:
    return [json.dumps({**RECORD, "doc_id": i, "baseline": i % 2, "candidate": (i // 2) % 2}) for i in range(8)]


def test_recompute_without_a_summary_has_nothing_to_compare(tmp_path, capsys):
    folder = write_eval_folder(tmp_path / "e", good_lines(), None)
    err = one_line_error(capsys, ["eval", "--recompute", str(folder)], "eval")
    assert "no summary.json" in err and "nothing to compare" in err


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (json.dumps({**RECORD, "baseline": [1, 2], "candidate": 1}), "baseline must be a number"),
        (json.dumps({**RECORD, "baseline": 1, "candidate": {"a": 1}}), "candidate must be a number"),
        (json.dumps({**RECORD, "task": ["x"], "baseline": 1, "candidate": 1}), "task must be a string"),
        ('{"task": "a", "metric": "acc", "baseline": ' + "9" * 4000 + ', "candidate": 1}', "too large"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ("[1, 2]", "not a per-document record"),
        ("not json", "not valid JSON"),
    ],
)
def test_recompute_refuses_hostile_per_document_lines(tmp_path, capsys, line, message):
    folder = write_eval_folder(tmp_path / "e", [*good_lines(), line], '{"rows": []}')
    assert message in one_line_error(capsys, ["eval", "--recompute", str(folder)], "eval")


@pytest.mark.parametrize(
    ("summary", "message"),
    [
        ('{"rows": 5}', "not a kha eval summary"),
        ("not json", "not valid JSON"),
        ("[]", "not a kha eval summary"),
        ('{"rows": [5]}', "rows[0] is not a row"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_recompute_refuses_hostile_summaries(tmp_path, capsys, summary, message):
    folder = write_eval_folder(tmp_path / "e", good_lines(), summary)
    assert message in one_line_error(capsys, ["eval", "--recompute", str(folder)], "eval")


def test_recompute_of_an_empty_file_is_no_pass(tmp_path, capsys):
    folder = write_eval_folder(tmp_path / "e", [], '{"rows": []}')
    assert "nothing to compare" in one_line_error(capsys, ["eval", "--recompute", str(folder)], "eval")


def test_recompute_still_reports_a_match_and_a_row_missing_from_the_data(tmp_path, capsys):
    from kha_hf.eval.paired import recompute

    folder = write_eval_folder(tmp_path / "e", good_lines(), '{"rows": []}')
    rows = recompute(folder)["rows"]
    (folder / "summary.json").write_text(json.dumps({"rows": rows}))
    assert main(["eval", "--recompute", str(folder)]) == 0
    assert "every paired statistic equals" in capsys.readouterr().out
    extra = {"task": "hellaswag", "metric": "acc", "paired": rows[0]["paired"]}
    (folder / "summary.json").write_text(json.dumps({"rows": [*rows, extra]}))
    assert main(["eval", "--recompute", str(folder)]) == 1
    assert "hellaswag acc (in summary.json only)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra", [["--candidate", "x"], ["--tasks", "arc_easy"], ["--suite", "quick"], ["--limit", "3"], ["--seed", "1"]]
)
def test_recompute_refuses_options_it_would_ignore(tmp_path, capsys, extra):
    folder = write_eval_folder(tmp_path / "e", good_lines(), '{"rows": []}')
    err = one_line_error(capsys, ["eval", "--recompute", str(folder), *extra], "eval")
    assert "cannot be combined with" in err and extra[0] in err


def test_perplexity_of_an_empty_file(kha, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    argv = ["eval", "--candidate", str(kha), "--tasks", "arc_easy", "--perplexity", str(tmp_path / "empty.txt")]
    assert "holds no text" in one_line_error(capsys, [*argv, "--output", str(tmp_path / "e")], "eval")
    assert not (tmp_path / "e").exists()


def test_perplexity_of_one_token_is_an_error_not_a_division_by_zero():
    from kha_hf.eval.perplexity import strided_perplexity

    class Tok:
        def __call__(self, text, return_tensors=None):
            return type("T", (), {"input_ids": torch.tensor([[5]])})()

    model = torch.nn.Linear(1, 1)
    with pytest.raises(KHAError, match="at least 2"):
        strided_perplexity(model, Tok(), "x")


# --- CLI values bounded before anything is allocated ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "command", "message"),
    [
        (["convert", "{base}", "{out}", "--knock-layers", "0-999999999"], "convert", "no model has that many layers"),
        (["convert", "{base}", "{out}", "--knock-layers", "99999999999999999999"], "convert", "that many layers"),
        (["train", "{kha}", "--output", "{out}", "--batch-size", "1000000000"], "train", "at most 65,536"),
        (["train", "{kha}", "--output", "{out}", "--seq-len", "1000000000000"], "train", "--seq-len"),
        (["train", "{kha}", "--output", "{out}", "--grad-accum", "1000000000"], "train", "--grad-accum"),
        (["train", "{kha}", "--output", "{out}", "--lora-r", "1000000000"], "train", "--lora-r"),
        (["train", "{kha}", "--output", "{out}", "--max-steps", "10000000000000"], "train", "--max-steps"),
        (["ab", "--output", "{out}", "--batch-size", "1000000000"], "ab", "--batch-size"),
        (["ab", "--output", "{out}", "--seeds", "100000"], "ab", "--seeds"),
        (["ab", "--output", "{out}", "--seed", "4294967295", "--seeds", "2"], "ab", "largest seed"),
        (["eval", "--candidate", "{kha}", "--batch-size", "1000000000"], "eval", "--batch-size"),
        (["demo", "--train-steps", "10000000000000"], "demo", "--train-steps"),
    ],
)
def test_sizes_are_capped_before_anything_is_allocated(kha, base, tmp_path, capsys, argv, command, message):
    argv = [a.format(base=base, kha=kha, out=tmp_path / "out") for a in argv]
    assert message in one_line_error(capsys, argv, command)
    assert not (tmp_path / "out").exists()


def test_lora_rank_above_the_model_width_is_refused_before_lora_is_built(kha, text, tmp_path, capsys, monkeypatch):
    import kha_hf.training.train as train_module

    def never(*args, **kwargs):
        raise AssertionError("LoRA was built")

    monkeypatch.setattr(train_module, "prepare_for_mode", never)
    argv = ["train", str(kha), "--output", str(tmp_path / "o"), "--data", str(text), *SMALL, "--mode", "lora"]
    assert "exceeds the model's hidden size 64" in train_error(capsys, [*argv, "--lora-r", "1000"])


@pytest.mark.parametrize("command", ["train", "ab", "eval"])
@pytest.mark.parametrize("seed", ["-5", "1e23", "4294967296", "nan"])
def test_seeds_are_checked_by_the_parser(kha, tmp_path, capsys, command, seed):
    argv = {
        "train": ["train", str(kha), "--output", str(tmp_path / "o")],
        "ab": ["ab", "--output", str(tmp_path / "o")],
        "eval": ["eval", "--candidate", str(kha), "--output", str(tmp_path / "o")],
    }[command]
    err = one_line_error(capsys, [*argv, "--seed", seed], command)
    assert "argument --seed" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [("evil", "not a Trainer logger"), ("tensorboard,evil", "'evil'"), ("none,evil", "cannot be combined")],
)
def test_report_to_is_checked_before_the_model_loads(kha, tmp_path, capsys, monkeypatch, value, message):
    never_loads(monkeypatch)
    err = one_line_error(capsys, ["train", str(kha), "--output", str(tmp_path / "o"), "--report-to", value], "train")
    assert message in err


# --- hostile configs: one line at the config-loading boundary ------------------------------------------------------
HOSTILE_CONFIGS = [
    ({"hidden_act": "evil"}, "hidden_act 'evil' is not an activation"),
    ({"rope_parameters": {"rope_type": "evil", "rope_theta": 10000.0}}, "rope_type 'evil'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta must be a positive number"),
    ({"rope_theta": "abc"}, "rope_theta must be a positive number"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "factor must be a positive number"),
    ({"layer_types": ["linear_attention", "linear_attention"]}, "'linear_attention', which a llama model does not"),
    ({"layer_types": ["full_attention"]}, "layer_types lists 1 layers"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps is not a finite number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, "is not a finite number"),
]


@pytest.mark.parametrize(("changes", "message"), HOSTILE_CONFIGS)
def test_hostile_config_values_are_one_line_errors(base, kha, text, tmp_path, capsys, changes, message):
    edit_config(base, **changes)
    edit_config(kha, **changes)
    for argv, command in (
        (["convert", str(base), str(tmp_path / "out")], "convert"),
        (["verify", str(base), str(kha)], "verify"),
        (["train", str(kha), "--output", str(tmp_path / "out"), "--data", str(text), *SMALL], "train"),
        (["inspect", str(kha)], "inspect"),
        (["fold", str(kha), str(tmp_path / "out")], "fold"),
        (["eval", "--candidate", str(kha), "--tasks", "arc_easy", "--output", str(tmp_path / "out")], "eval"),
    ):
        assert message in one_line_error(capsys, argv, command), command
    assert not (tmp_path / "out").exists()


def test_a_config_nested_too_deeply_is_one_line(kha, tmp_path, capsys):
    (kha / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    err = one_line_error(capsys, ["train", str(kha), "--output", str(tmp_path / "o")], "train")
    assert "nests too deeply" in err


# --- hostile safetensors --------------------------------------------------------------------------------------------
def write_raw_safetensors(path: Path, header: str, data: bytes = b"") -> None:
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_safetensors_header_nested_100000_deep(base, tmp_path, capsys):
    write_raw_safetensors(base / "model.safetensors", '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    err = one_line_error(capsys, ["convert", str(base), str(tmp_path / "out")], "convert")
    assert "header nests too deeply" in err


def test_a_tensor_listed_twice_in_one_header_is_refused(base, tmp_path, capsys):
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    write_raw_safetensors(base / "model.safetensors", f'{{"x": {entry}, "x": {entry}}}', b"\0" * 4)
    err = one_line_error(capsys, ["convert", str(base), str(tmp_path / "out")], "convert")
    assert "'x' is listed twice" in err
    assert not (tmp_path / "out").exists()


def test_integer_knocks_and_embeddings_are_refused(base, tmp_path, capsys):
    kha = tmp_path / "linear"  # a linear knock: fold reads it too
    save_tiny_checkpoint(kha, knock="linear_qkv", num_hidden_layers=2)
    weights = load_file(kha / "model.safetensors")
    name = next(k for k in weights if "v_knock" in k)
    weights[name] = weights[name].to(torch.int32)
    save_file(weights, kha / "model.safetensors", metadata={"format": "pt"})
    for argv, command in ((["inspect", str(kha)], "inspect"), (["fold", str(kha), str(tmp_path / "o")], "fold")):
        assert "not a floating-point tensor" in one_line_error(capsys, argv, command)
    weights = load_file(base / "model.safetensors")
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].to(torch.int32)
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    err = one_line_error(capsys, ["convert", str(base), str(tmp_path / "o")], "convert")
    assert "embedding is stored as torch.int32" in err
    assert not (tmp_path / "o").exists()


# --- resume from a checkpoint that is not plain weights -------------------------------------------------------------
class Evil:
    pass


def test_resume_from_a_checkpoint_with_a_non_weights_pickle(kha, text, tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["train", str(kha), "--output", str(out), "--data", str(text), *SMALL, "--save-steps", "1"]
    assert main([*argv, "--max-steps", "2"]) == 0
    torch.save({"state": Evil()}, out / "checkpoint-2" / "optimizer.pt")
    err = train_error(capsys, [*argv, "--max-steps", "4", "--resume"])
    assert "not plain weights" in err and "Evil" in err and "nothing of it ran" in err
    assert (out / "model.safetensors").is_file()  # the finished run is as it was


# --- ordering and wording of errors -------------------------------------------------------------------------------
def test_push_to_hub_repo_id_is_checked_before_converting(base, tmp_path, capsys, monkeypatch):
    import kha_hf.conversion.converter as converter

    # convert() checks the id first: nothing of SRC is resolved or converted before
    monkeypatch.setattr(converter, "resolve_source", lambda *a, **k: pytest.fail("converted first"))
    argv = ["convert", str(base), str(tmp_path / "out"), "--push-to-hub", "bad repo!!"]
    assert "--push-to-hub 'bad repo!!' is not a valid Hub repo id" in one_line_error(capsys, argv, "convert")
    assert not (tmp_path / "out").exists()


def test_push_checks_the_repo_id(kha, capsys):
    assert "REPO_ID" in one_line_error(capsys, ["push", str(kha), "no//good"], "push")


def test_demo_with_a_missing_model_names_the_option_before_the_banner(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, ["demo", "--model", "./nope"], "demo")
    assert "--model './nope'" in err and "SRC" not in err
    assert not (tmp_path / "kha-demo").exists()


def test_demo_banner_is_not_printed_for_a_missing_model(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    main(["demo", "--model", "./nope"])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("command", ["train", "eval", "convert", "inspect"])
def test_leftover_arguments_are_the_subcommands_error(kha, tmp_path, capsys, command):
    argv = {
        "train": ["train", str(kha), "--output", str(tmp_path / "o")],
        "eval": ["eval", "--candidate", str(kha)],
        "convert": ["convert", str(kha), str(tmp_path / "o")],
        "inspect": ["inspect", str(kha)],
    }[command]
    err = one_line_error(capsys, [*argv, "--bogus", "x"], command)
    assert "unrecognized arguments: --bogus x" in err and f"kha {command} --help" in err


def test_top_level_errors_stay_the_top_levels(capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--bogus"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("kha: error: ")


def test_the_differing_code_note_does_not_promise_a_flag(tmp_path):
    from kha_hf.checkpoint.loading import remote_code_kwargs

    folder = tmp_path / "kha"
    save_tiny_checkpoint(folder, knock="mlp_v", num_hidden_layers=2)
    (folder / "modeling_kha.py").write_text("# changed\n")
    notes = []
    remote_code_kwargs(folder, echo=notes.append)
    assert len(notes) == 1 and "--trust-remote-code" not in notes[0] and "not run" in notes[0]


def custom_code_tokenizer(folder: Path, marker: Path) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(
        auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}, tokenizer_class="EvilTokenizer"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )


def test_a_tokenizer_code_error_never_advises_a_flag_the_command_lacks(base, text, tmp_path, capsys):
    marker = tmp_path / "ran"
    custom_code_tokenizer(base, marker)
    err = one_line_error(capsys, ["train", str(base), "--output", str(tmp_path / "o"), "--data", str(text)], "train")
    assert "tokenizer code" in err and "--trust-remote-code" not in err and "--tokenizer" in err
    argv = ["eval", "--candidate", str(base), "--tasks", "arc_easy", "--output", str(tmp_path / "e")]
    err = one_line_error(capsys, argv, "eval")  # eval has --trust-remote-code, but no --tokenizer
    assert "--trust-remote-code" in err and "--tokenizer" not in err
    assert not marker.exists()


def test_converting_a_base_with_a_custom_code_tokenizer_is_refused_up_front(base, tmp_path, capsys):
    marker = tmp_path / "ran"
    custom_code_tokenizer(base, marker)
    err = one_line_error(capsys, ["convert", str(base), str(tmp_path / "out")], "convert")
    assert "tokenizer needs its own code" in err and "EvilTokenizer" in err
    assert not (tmp_path / "out").exists() and not marker.exists()


def test_a_known_tokenizer_class_with_an_auto_map_still_converts(base, tmp_path):
    from kha_hf.checkpoint.loading import check_tokenizer_needs_no_code

    config = json.loads((base / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_x.X", None]}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    check_tokenizer_needs_no_code(base)  # transformers has the class: it loads without the folder's code


def test_an_interrupted_progress_bar_leaves_no_traceback(capsys):
    import gc

    from tqdm.auto import tqdm

    from kha_hf.cli import _quiet_interrupted_progress_bars

    class Half(tqdm):  # what a SIGTERM inside tqdm's constructor leaves behind
        def __init__(self, *args, **kwargs):
            self.disable = False
            raise KeyboardInterrupt("received SIGTERM")

    _quiet_interrupted_progress_bars()
    try:
        Half(total=3)
    except KeyboardInterrupt:
        pass
    gc.collect()
    assert "Traceback" not in capsys.readouterr().err


def test_finite_checks_do_not_refuse_ordinary_configs(base):
    from kha_hf.checkpoint.checks import check_config_values

    config = json.loads((base / "config.json").read_text())
    check_config_values(config, "config.json")
    assert all(not (isinstance(v, float) and not math.isfinite(v)) for v in config.values())
