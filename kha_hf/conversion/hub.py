"""Uploading a finished folder to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

from ..checkpoint.output import PARTIAL_MARKER
from ..checkpoint.paths import OUTPUT_MARKER
from ..common.errors import KHAError


def push_folder(folder: str | Path, repo_id: str, private: bool = False, token: str | None = None) -> str:
    """Create (or reuse) the model repo and upload every file of `folder`; returns the commit URL."""
    from huggingface_hub import HfApi

    from ..checkpoint.loading import check_hub_repo_id

    check_hub_repo_id(repo_id, "REPO_ID")
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise KHAError(f"{folder} is not a checkpoint folder (no config.json)")

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            repo_type="model",
            folder_path=str(folder),
            ignore_patterns=[OUTPUT_MARKER, PARTIAL_MARKER],  # kha's own bookkeeping, not part of the model
            commit_message="Upload KHA checkpoint converted with kha-hf",
        )
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise KHAError(f"cannot push {folder} to the Hub repo {repo_id!r}: {reason}") from err
    return str(getattr(commit, "commit_url", commit))
