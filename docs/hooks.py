"""mkdocs hooks (mkdocs.yml `hooks:`): the generated references and the CLI-flag check.

- `reference/cli.md` is rendered from the argparse parser that `kha` itself builds (`kha_hf.cli.build_parser`), every
  subcommand's usage, options, defaults and help, so a new flag appears without anyone writing it down.
- `reference/api.md` holds one mkdocstrings block for every name in `kha_hf.__all__`, rendered from the docstrings.
- Every `kha <command> ... --flag` in a page (code blocks and inline code) must name a flag that command's parser
  has: a stale flag is a warning naming the page and line, which `mkdocs build --strict` turns into a failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.hooks.kha")
_PARSER: argparse.ArgumentParser | None = None


def cli_parser() -> argparse.ArgumentParser:
    """The parser `kha` builds (imported from the checkout, with a fixed width so the page does not depend on the
    terminal that builds it)."""
    global _PARSER
    if _PARSER is None:
        sys.path.insert(0, str(ROOT))
        os.environ["COLUMNS"] = "110"
        sys.modules.setdefault("kha_hf_entry", type(sys)("kha_hf_entry"))  # defer model registration, as `kha` does
        sys.modules["kha_hf_entry"].DEFER_REGISTRATION = True
        from kha_hf.cli import build_parser

        _PARSER = build_parser()
    return _PARSER


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {opt for action in parser._actions for opt in action.option_strings}


# --- the CLI reference


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            name = f"`{action.metavar or action.dest}`"
        default = action.default
        shown = "" if default in (None, argparse.SUPPRESS, False) or action.nargs == 0 else f"`{default}`"
        choices = f" (one of {', '.join(f'`{c}`' for c in action.choices)})" if action.choices else ""
        help_text = (action.help or "") % {"default": default, "prog": parser.prog} if action.help else ""
        rows.append(f"| {name} | {_escape(help_text)}{choices} | {shown} |")
    return rows


def cli_reference() -> str:
    parser = cli_parser()
    out = [
        "# CLI reference",
        "",
        "Generated when the site is built, from the parser `kha` itself uses (`kha_hf.cli.build_parser`): every",
        "subcommand with its usage, options, defaults and examples. `kha COMMAND --help` prints the same text.",
        "",
        "## kha",
        "",
        "```text",
        parser.format_help().rstrip(),
        "```",
        "",
    ]
    for name, sub in subcommands(parser).items():
        out += [f"## kha {name}", "", "```text", sub.format_usage().rstrip(), "```", ""]
        if sub.description:
            out += [_escape(sub.description), ""]
        out += ["| argument | what it does | default |", "|---|---|---|", *_option_rows(sub), ""]
        if sub.epilog:
            out += ["```text", sub.epilog.strip("\n"), "```", ""]
    return "\n".join(out) + "\n"


# --- the API reference


def public_names() -> list[tuple[str, str]]:
    """(name, the dotted path mkdocstrings renders) for every name in kha_hf.__all__: lazily imported names point
    at the module that defines them (kha_hf._LAZY), the rest at kha_hf itself (griffe follows the import)."""
    import kha_hf

    lazy = getattr(kha_hf, "_LAZY", {})
    out = []
    for name in kha_hf.__all__:
        if name in lazy:
            module = lazy[name]
            out.append((name, f"kha_hf{module}.{name}" if module.startswith(".") else f"{module}.{name}"))
        else:
            out.append((name, f"kha_hf.{name}"))
    return out


GROUPS = [  # (title, names): names not listed here land in "Other"
    (
        "Models and configuration",
        [
            "KHAConfig",
            "KHAModel",
            "KHAPreTrainedModel",
            "KHAForCausalLM",
            "KHAForConditionalGeneration",
            "KHAForSequenceClassification",
            "KHAForTokenClassification",
            "KHAForQuestionAnswering",
        ],
    ),
    ("Knock adapters (PEFT)", ["KnockConfig"]),
    (
        "Training",
        [
            "KHATrainer",
            "optimizer_param_groups",
            "count_knock_parameters",
            "is_knock_parameter",
            "knock_parameter_names",
            "knock_target_modules",
        ],
    ),
    ("Tools (what the CLI calls)", ["convert", "fold", "verify_conversion", "run_eval"]),
    (
        "Constants and errors",
        ["DEFAULT_KNOCK", "KNOCK_PRESETS", "SUPPORTED_BASE_MODEL_TYPES", "KHAError", "__version__"],
    ),
]


def api_reference() -> str:
    names = dict(public_names())
    out = [
        "# Python API reference",
        "",
        "Generated when the site is built from the docstrings of every name in `kha_hf.__all__`.",
        "`import kha_hf` registers the KHA classes with transformers' Auto classes and the `KNOCK` adapter type with",
        "peft; the names below import on first use (`from kha_hf import KHAForCausalLM, convert`).",
        "",
    ]
    listed = set()
    for title, group in [*GROUPS, ("Other", [n for n in names if not any(n in g for _, g in GROUPS)])]:
        present = [n for n in group if n in names]
        if not present:
            continue
        out += [f"## {title}", ""]
        for name in present:
            listed.add(name)
            out += [f"::: {names[name]}", "    options:", "      heading_level: 3", f'      toc_label: "{name}"', ""]
    return "\n".join(out) + "\n"


def on_files(files, config):
    for uri, render in (("reference/cli.md", cli_reference), ("reference/api.md", api_reference)):
        files.append(File.generated(config, uri, content=render()))
    return files


# --- stale CLI flags

COMMAND = re.compile(r"(?:^|[\s`(\"'$])(?:kha|-m kha_hf)\s+(--[\w-]+|[a-z]+)")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")


def stale_flags(markdown: str) -> list[tuple[int, str, str]]:
    """(line, command, flag) for each `kha COMMAND ... --flag` whose parser lacks the flag. A command runs to the end
    of its line (a trailing backslash continues it), to an inline code span's end, to the next `kha`, or to `#`,
    `|`, `;`, `&&`."""
    parser = cli_parser()
    subs = subcommands(parser)
    found = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        for m in COMMAND.finditer(line):
            word = m.group(1)
            rest = line[m.end(1) :]
            rest = re.split(r"`|\s#|\s\||;|&&|\$\(|\)|\skha\s", rest, maxsplit=1)[0]  # up to the next command
            if word.startswith("--"):
                command, known, rest = "kha", flags(parser), word + rest
            elif word in subs:
                command, known = f"kha {word}", flags(subs[word])
            else:
                continue  # prose: "kha the tool", "kha-hf"
            for flag in FLAG.findall(rest):
                if flag not in known:
                    found.append((number, command, flag))
        i += 1
    return found


# --- links, with the line they stand on (mkdocs' own link warnings name the page only)

LINK = re.compile(r"\]\(([^)\s]+)\)")
_LINKS: list[tuple[str, int, str, str]] = []  # (page, line, target page, anchor)


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    for number, command, flag in stale_flags(markdown):
        log.warning(f"{src}:{number}: `{command}` has no flag {flag} (kha_hf.cli's parser)")
    fenced = False
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(src), path)) if path else src
            if files.get_file_from_path(resolved) is None:
                log.warning(f"{src}:{number}: the link {target} points to {resolved}, which is not in docs/")
            elif anchor and resolved.endswith(".md"):
                _LINKS.append((src, number, resolved, anchor))
    return markdown


def on_env(env, config, files):
    """Every page is rendered by now: check each link's anchor against the ids of its target page."""
    ids: dict[str, set[str]] = {}
    for file in files.documentation_pages():
        content = file.page.content if file.page is not None and file.page.content else ""
        ids[file.src_uri] = set(re.findall(r'id="([^"]+)"', content))
    for src, number, target, anchor in _LINKS:
        if anchor not in ids.get(target, set()):
            log.warning(f"{src}:{number}: the link's anchor #{anchor} is not a heading or id of {target}")
    _LINKS.clear()
    return env
