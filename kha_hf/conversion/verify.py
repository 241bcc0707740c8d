"""`kha verify`: a converted KHA checkpoint must reproduce its base model's logits and greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.knock_reader import NotAKHACheckpoint, open_kha_checkpoint
from ..checkpoint.reader import Checkpoint, open_checkpoint
from ..common.errors import KHAError

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Knocking heads attention lets attention heads",
)
# identity knocks are exact in any dtype; half precision still gets a stated tolerance for kernel differences
TOLERANCE = {torch.float32: 0.0, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass
class VerifyReport:
    max_abs_diff: float
    tolerance: float
    base_tokens: list[list[int]]
    kha_tokens: list[list[int]]

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.base_tokens == self.kha_tokens


def compare_models(base_model, kha_model, tokenizer, prompts=PROMPTS, max_new_tokens: int = 16, echo=None) -> tuple:
    """Max |Δlogit| over the prompts and each model's greedy continuation tokens.

    `echo`, when given, gets one line per prompt before it runs: a large model on CPU takes seconds per prompt.
    """
    max_diff, base_tokens, kha_tokens = 0.0, [], []
    device = next(kha_model.parameters()).device
    for i, prompt in enumerate(prompts, 1):
        if echo is not None:
            echo(f"verifying prompt {i}/{len(prompts)}: logits and {max_new_tokens} greedy tokens of both models")
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            kha_logits, base_logits = kha_model(ids).logits.double(), base_model(ids).logits.double()
        for name, logits in (("the base model", base_logits), ("the KHA model", kha_logits)):
            if not torch.isfinite(logits).all():  # max() would drop a NaN and report a perfect 0
                raise KHAError(
                    f"{name} computes NaN or infinite logits on prompt {i} ({prompt!r}): nothing to compare; "
                    "check its config.json (e.g. rms_norm_eps) and weights"
                )
        diff = (kha_logits - base_logits).abs().max().item()
        max_diff = max(max_diff, diff)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        base_tokens.append(base_model.generate(ids, **kwargs)[0, ids.shape[1] :].tolist())
        kha_tokens.append(kha_model.generate(ids, **kwargs)[0, ids.shape[1] :].tolist())
    return max_diff, base_tokens, kha_tokens


def verify_conversion(
    base: str | Path,
    kha_dir: str | Path,
    device: str = "cpu",
    dtype: str = "float32",
    prompts=PROMPTS,
    max_new_tokens: int = 16,
    echo=print,
    tokenizer: str | Path | None = None,
    trust_remote_code: bool = False,
    offer_tokenizer: bool = True,
) -> VerifyReport:
    """Load both models, print max |Δlogit| and greedy tokens; raise KHAError unless they agree.

    Code shipped inside BASE runs only with `trust_remote_code`; KHA_DIR loads with the installed kha_hf classes.

    Args:
        base: the base checkpoint (folder, Hub id or `.gguf`).
        kha_dir: the KHA checkpoint folder converted from it (a task head is compared on its head outputs).
        device: `cpu` (default), `cuda`, ...
        dtype: `float32` (default: the logits must be identical), `bfloat16` or `float16` (within 1e-2).
        prompts: the prompts run through both models (default: three short ones).
        max_new_tokens: greedy tokens generated per prompt and compared (default 16).
        echo: where the per-prompt lines go (default `print`).
        tokenizer: a tokenizer for a checkpoint saved without one.
        trust_remote_code: run code shipped inside BASE (default False).
        offer_tokenizer: say which `--tokenizer` to pass when a folder has none (default True).

    Returns:
        A `VerifyReport`: `max_abs_diff` over all prompts, the `tolerance` of the dtype, and each model's greedy
        tokens (`base_tokens`, `kha_tokens`: one list per prompt); `ok` is True when they agree.

    Raises:
        KHAError: the models differ (max |Δlogit| above the tolerance, or other greedy tokens), KHA_DIR is not a KHA
            checkpoint or not a conversion of BASE (another head or label count), a model cannot be loaded, or
            the logits are not finite.
    """
    from ..checkpoint.loading import check_device, check_model_ref, load_causal_lm, torch_dtype

    check_model_ref(base, "BASE")
    check_model_ref(kha_dir, "KHA_DIR")
    check_device(device)
    kha = _open_local(kha_dir, kha=True)  # read and checked, knocks too: each one there, d_h x d_h floating point
    if kha is None:
        raise KHAError(f"{kha_dir} is not a KHA checkpoint folder (its config.json has no model_type 'kha')")
    base_checkpoint = _open_local(base, trust_remote_code=trust_remote_code)  # both, before either is loaded
    head = kha.checkpoint.task_head()
    if head is not None:  # a reward model or classifier: its head's outputs, exactly
        checkpoints = (base_checkpoint, kha.checkpoint)
        return verify_task_head(
            base, kha_dir, head, device, dtype, prompts, echo, tokenizer, trust_remote_code, checkpoints
        )
    if base_checkpoint is not None:
        base_checkpoint.check_not_task_head()
    both = {"attn_implementation": "eager", "tokenizer": tokenizer, "offer_tokenizer": offer_tokenizer}
    base_model, _ = load_causal_lm(
        base, dtype, device, trust_remote_code=trust_remote_code, checked=base_checkpoint, **both
    )
    kha_model, tokenizer = load_causal_lm(kha_dir, dtype, device, checked=kha.checkpoint, **both)
    max_diff, base_tokens, kha_tokens = compare_models(
        base_model, kha_model, tokenizer, prompts, max_new_tokens, echo=echo
    )
    report = VerifyReport(max_diff, TOLERANCE[torch_dtype(dtype)], base_tokens, kha_tokens)
    echo(f"max |Δlogit| over {len(prompts)} prompts ({dtype}, {device}): {max_diff:.3e} (tolerance {report.tolerance})")
    for prompt, b, k in zip(prompts, base_tokens, kha_tokens, strict=True):
        echo(
            f"  {prompt!r}\n    base: {tokenizer.decode(b)!r}\n"
            f"    kha:  {tokenizer.decode(k)!r}{'' if b == k else '  <- differs'}"
        )
    if not report.ok:
        raise KHAError(
            f"verification failed: max |Δlogit| {max_diff:.3e} (tolerance {report.tolerance}), "
            f"greedy tokens {'equal' if base_tokens == kha_tokens else 'differ'}"
        )
    echo("verified: the KHA checkpoint reproduces its base model")
    return report


def _open_local(ref: str | Path, kha: bool = False, trust_remote_code: bool = False):
    """REF's checkpoint folder, opened and checked, when REF is a local folder of safetensors weights (not a Hub id,
    not a GGUF file); KHA: as a `KHACheckpoint`, None when it is not a KHA checkpoint."""
    from ..checkpoint.loading import find_gguf

    folder = Path(ref)
    if not folder.is_dir() or find_gguf(folder) is not None:
        return None
    if not kha:
        return open_checkpoint(folder, trust_remote_code=trust_remote_code)
    try:
        return open_kha_checkpoint(folder)
    except NotAKHACheckpoint:
        return None


def verify_task_head(
    base,
    kha_dir,
    head: str,
    device: str,
    dtype: str,
    prompts,
    echo,
    tokenizer,
    trust_remote_code: bool,
    checkpoints: tuple[Checkpoint | None, Checkpoint],
) -> VerifyReport:
    """A converted task-head checkpoint (HEAD, e.g. `KHAForSequenceClassification`) against its base: every output of
    the head (`logits`; `start_logits` / `end_logits` for question answering) within the dtype's tolerance, and the
    same predicted classes (reported where a causal LM reports greedy tokens). CHECKPOINTS: BASE's (None for a Hub
    id or GGUF file) and KHA_DIR's folders as `verify_conversion` opened and checked them."""
    import transformers

    from ..checkpoint.checks import num_labels
    from ..checkpoint.loading import describe_error, load_tokenizer, remote_code_kwargs, torch_dtype
    from ..modeling.configuration_kha import TASK_HEADS

    if head not in TASK_HEADS:
        raise KHAError(f"{kha_dir} names the architecture {head}; a KHA task head is one of {', '.join(TASK_HEADS)}")
    base_head = checkpoints[0].task_head() if checkpoints[0] is not None else None
    if base_head is None or not base_head.endswith(head.removeprefix("KHA")):
        raise KHAError(f"{kha_dir} is a {head}; BASE {base} is {base_head or 'not a checkpoint of that kind'}")
    labels = [num_labels(checkpoint.config) for checkpoint in checkpoints]
    if head != "KHAForQuestionAnswering" and labels[0] != labels[1]:
        raise KHAError(f"BASE {base} has {labels[0]} labels, {kha_dir} has {labels[1]}: not a conversion of it")
    auto = getattr(transformers, TASK_HEADS[head][0])
    tok = load_tokenizer(base, tokenizer, trust_remote_code, checkpoint=checkpoints[0])
    kwargs = {"dtype": torch_dtype(dtype), "attn_implementation": "eager"}
    models = []
    for ref, extra in ((base, remote_code_kwargs(base, trust_remote_code, checkpoint=checkpoints[0])), (kha_dir, {})):
        try:
            models.append(auto.from_pretrained(ref, **extra, **kwargs).to(device).eval())
        except (OSError, ValueError, RuntimeError) as err:  # RuntimeError: a head whose shape the config denies
            raise KHAError(f"cannot load {str(ref)!r}: {describe_error(err)}") from err
    base_model, kha_model = models
    max_diff, base_pred, kha_pred = 0.0, [], []
    for i, prompt in enumerate(prompts, 1):
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            outputs = [model(ids) for model in models]
        names = [n for n in ("logits", "start_logits", "end_logits") if getattr(outputs[0], n, None) is not None]
        for name in names:
            b, k = outputs[0][name].double(), outputs[1][name].double()
            if not (torch.isfinite(b).all() and torch.isfinite(k).all()):
                raise KHAError(f"NaN or infinite {name} on prompt {i} ({prompt!r}): nothing to compare")
            max_diff = max(max_diff, (k - b).abs().max().item())
        base_pred.append(outputs[0][names[0]].argmax(-1).flatten().tolist())
        kha_pred.append(outputs[1][names[0]].argmax(-1).flatten().tolist())
    report = VerifyReport(max_diff, TOLERANCE[torch_dtype(dtype)], base_pred, kha_pred)
    echo(
        f"max |Δ{names[0]}| over {len(prompts)} prompts ({dtype}, {device}, {head}): {max_diff:.3e} "
        f"(tolerance {report.tolerance}); predicted classes {'equal' if base_pred == kha_pred else 'differ'}"
    )
    if not report.ok:
        raise KHAError(f"verification failed: max |Δ{names[0]}| {max_diff:.3e} (tolerance {report.tolerance})")
    echo(f"verified: the KHA {head.removeprefix('KHAFor')} checkpoint reproduces its base model")
    return report
