"""`kha push FOLDER REPO_ID`: upload a checkpoint folder to the Hub (kha_hf.conversion.hub)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser(
        "push",
        help="upload a checkpoint folder (KHA, trained or folded) to the Hugging Face Hub",
        description="Create the model repo if needed and upload every file of FOLDER (weights, config, remote code, "
        "tokenizer, model card).",
        epilog="example:\n  kha push ./smollm2-kha-trained me/smollm2-kha --private",
    )
    p.add_argument("folder", metavar="FOLDER", help="checkpoint folder to upload (must hold config.json)")
    p.add_argument("repo_id", metavar="REPO_ID", help="Hub model repo, owner/name (created if missing)")
    p.add_argument("--private", action="store_true", help="create the repo as private")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..conversion.hub import push_folder

    print(f"uploaded {args.folder} to {args.repo_id}: {push_folder(args.folder, args.repo_id, private=args.private)}")
