"""`kha train`: continue training a KHA model (knocks only, knocks + LoRA, or full) with transformers' Trainer.

The paper's optimiser settings are the defaults: AdamW, weight decay 0.1 (never on knocks), betas (0.9, 0.95),
gradient clipping 1.0, 5 % warmup, cosine decay to 10 % of the peak learning rate.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint.api import CheckpointException
from transformers import TrainingArguments, default_data_collator

from ..checkpoint.loading import check_model_ref, load_tokenizer
from ..checkpoint.output import check_adoptable, check_free_space, check_no_interrupted_run, resumable_partials
from ..checkpoint.paths import check_run_destination, check_run_place, is_training_run
from ..checkpoint.reader import open_checkpoint
from ..common.errors import KHAError
from ..common.model_card import carry_training_card
from ..data.corpus import TOKENIZER_DIR
from ..modeling.configuration_kha import SUPPORTED_BASE_MODEL_TYPES
from ..modeling.modeling_kha import KHAForCausalLM
from .corpus_data import (
    MAX_PREPARED_EVAL_BLOCKS,
    check_resumed_record,
    check_vocabulary_fits,
    corpus_splits,
    prepared_corpus,
    run_record,
    write_run_record,
)
from .data import read_documents, train_heldout_split, train_validation_heldout_split
from .deepspeed_config import check_deepspeed_config, quiet_deepspeed_cpu_notice
from .from_config import (
    check_model_fits,
    is_config_ref,
    kha_config_from,
    model_from_config,
    pretraining_lr,
    stated_vocab_size,
    weight_bytes,
)
from .guards import (
    StopOnNonFiniteLoss,
    check_batches,
    check_lora_rank,
    check_report_to,
    check_training_result,
    unpickling_reason,
)
from .modes import DEFAULT_LR, prepare_for_mode
from .parallel import (
    build_sharded,
    check_distributed_loading,
    check_plan_fits,
    hand_over_from_accelerate,
    is_main_process,
    load_sharded,
    plan_from_launch,
    world_size,
)
from .resume_files import (
    TRAINER_STATE,
    check_checkpoint_files,
    check_random_states,
    check_run_entries,
    last_complete_checkpoint,
    resume_lock,
)
from .run_dir import run_output_dir
from .run_state import check_resumed_layout
from .schedules import Schedule
from .spikes import SPIKE_MARGIN, check_spike_margin
from .stability import STABILITY_FILE, iter_stability_lines, stability_metrics
from .throughput import parameter_line
from .trainer import CheckpointCodeCallback, KHATrainer
from .validation_log import VALIDATION_FILE, ValidationRecord


@dataclass
class TrainResult:
    output_dir: Path
    train_loss: float
    heldout_loss: float
    steps: int
    log_history: list[dict] = field(default_factory=list)
    adapter_dir: Path | None = None
    heldout_loss_before: float | None = None


def check_training_numbers(**numbers: int | None) -> None:
    """Step counts and sizes must be positive integers (the CLI checks too; this guards API callers)."""
    for name, value in numbers.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise KHAError(f"{name} must be a positive integer, got {value!r}")


def check_positions(config, seq_len: int) -> None:
    """A block longer than the model's positions would train positions it has never had (or index past them).
    CONFIG: a config object or a checkpoint's config dict."""
    if isinstance(config, dict):
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        positions = text.get("max_position_embeddings")
    else:
        positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len > positions:
        raise KHAError(f"--seq-len {seq_len} is past the model's {positions} positions (max_position_embeddings)")


def check_token_ids(train_set, heldout_set, config) -> None:
    """The tokenizer's ids in the blocks fit CONFIG's vocabulary: one past the embedding is an IndexError in the
    first forward (a --tokenizer of another model)."""
    vocab = config.get_text_config().vocab_size
    largest = max(int(blocks.blocks.max()) for blocks in (train_set, heldout_set))
    if isinstance(vocab, int) and largest >= vocab:
        raise KHAError(
            f"the tokenizer gives token id {largest}, past the model's vocabulary of {vocab}: train with the "
            "model's own tokenizer (leave out --tokenizer, or name the one it was trained with)"
        )


def _trainable(config: dict, folder: Path) -> None:
    """`open_checkpoint`'s ACCEPT: a KHA checkpoint or a base checkpoint of a supported family."""
    model_type = config.get("model_type")
    if model_type != "kha" and model_type not in SUPPORTED_BASE_MODEL_TYPES:
        raise KHAError(
            f"{folder} is a {model_type!r} model; kha trains KHA checkpoints and base checkpoints of: "
            f"{', '.join(SUPPORTED_BASE_MODEL_TYPES)} (convert other architectures first: kha convert)"
        )


def paper_training_arguments(output_dir: Path, **overrides) -> TrainingArguments:
    """TrainingArguments with the paper's optimiser and schedule; `overrides` win."""
    args = dict(
        output_dir=str(output_dir),
        optim="adamw_torch",
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        warmup_steps=0.05,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},
        include_num_input_tokens_seen=True,
        report_to="none",
        save_total_limit=2,
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        logging_nan_inf_filter=False,  # a NaN loss is logged as NaN (and stops the run), never averaged away
    )
    args.update(overrides)
    try:
        return TrainingArguments(**args)
    except ValueError as err:  # accelerate's own checks of its config (a DeepSpeed file beside yaml fields it ignores)
        raise KHAError(f"the training configuration: {' '.join(str(err).split())[:400]}") from None


def train(
    model_path: str | Path,
    output_dir: str | Path,
    data: list[str] | None = None,
    mode: str = "knocks",
    max_steps: int = 200,
    seq_len: int = 256,
    batch_size: int = 8,
    grad_accum: int = 1,
    lr: float | None = None,
    knock_lr: float | None = None,
    bf16: bool = False,
    gradient_checkpointing: bool = False,
    resume: bool = False,
    trust_checkpoint_pickle: bool = False,
    save_steps: int | None = None,
    logging_steps: int | None = None,
    seed: int = 0,
    report_to: str = "none",
    lora_r: int = 16,
    max_eval_blocks: int | None = 256,
    disable_tqdm: bool = False,
    eval_before: bool = False,
    tokenizer: str | Path | None = None,
    overwrite: bool = False,
    knock: str | None = None,
    logit_every: int | None = None,
    spike_margin: float = SPIKE_MARGIN,
    tp_size: int | None = None,
    ep_size: int | None = None,
    lr_scheduler: str = "cosine",
    warmup_steps: int | None = None,
    warmup_ratio: float | None = None,
    min_lr_ratio: float | None = None,
    decay_ratio: float | None = None,
    eval_steps: int | None = None,
    peak_flops: float | None = None,
) -> TrainResult:
    """Train MODEL_PATH (a KHA checkpoint, or a config or preset: new weights) and save it to OUTPUT_DIR.

    DATA: text files, folders or a Hub dataset (tokenized in memory), or one corpus prepared by `kha tokenize` (read
    lazily: memory stays flat however large it is). KNOCK: the knocks of a base family's config. Returns the losses.

    Under `accelerate launch` with an FSDP2 config, or with TP_SIZE / EP_SIZE, transformers shards the model at load
    time (training/parallel.py) on CPUs and GPUs alike, and kha saves what an exact resume needs (run_state.py).

    LR: the peak learning rate; by default the mode's (a checkpoint), or for new weights (a config or preset with
    --mode full) the preset's (`from_config.pretraining_lr`). LR_SCHEDULER and its numbers: training/schedules.py
    (the paper's cosine by default). EVAL_STEPS: the validation split's loss every N steps (trainer_state.json,
    OUTPUT/validation.jsonl). PEAK_FLOPS: one device's peak, for the MFU in each log (training/throughput.py).

    OUTPUT_DIR follows the rules of `kha convert`: never the model, a folder holding it, the working directory, home,
    a root or a folder inside the data; an existing one only with `overwrite` (or `resume`). The run works in a
    temporary sibling that becomes OUTPUT_DIR when the model is saved, so an interrupted run or save leaves any
    earlier OUTPUT_DIR as it was; an interrupted run with checkpoints is kept for `resume`.
    """
    check_training_numbers(
        max_steps=max_steps, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum, logit_every=logit_every,
        eval_steps=eval_steps,
    )  # fmt: skip
    schedule = Schedule(lr_scheduler, warmup_steps, warmup_ratio, min_lr_ratio, decay_ratio)
    schedule_args = schedule.training_arguments(max_steps)  # a choice that does not apply: refused before any work
    if peak_flops is not None and not 0 < peak_flops < float("inf"):
        raise KHAError(f"peak_flops must be a positive number of FLOP/s, got {peak_flops}")
    try:
        spike_margin = check_spike_margin(spike_margin)
    except ValueError as err:
        raise KHAError(str(err)) from err
    for name, value in (("lr", lr), ("knock_lr", knock_lr)):
        if value is not None and not value >= 0:
            raise KHAError(f"{name} must be >= 0, got {value}")
    report_to = check_report_to(report_to)  # a list: TrainingArguments does not split 'tensorboard,wandb'
    plan = plan_from_launch(tp_size, ep_size)  # FSDP2 / TP / EP: checked once, before anything is read
    if plan is not None:
        check_distributed_loading()
        if mode == "lora":
            raise KHAError(f"--mode lora is not offered under {plan.engine().split(',')[0]}: use --mode knocks or full")
    from_config = is_config_ref(model_path)
    if from_config and mode != "full":
        raise KHAError(f"{model_path} is a config: its weights are new and train with --mode full, not --mode {mode}")
    if knock is not None and not from_config:
        raise KHAError("--knock applies when MODEL is a config or a preset; a checkpoint keeps its own knocks")
    if not from_config:
        check_model_ref(model_path)
    local_checkpoint = None  # MODEL's folder, opened and checked once
    if Path(model_path).exists():  # adapters record their base model's path: make it absolute
        model_path = Path(model_path).resolve()
        if not from_config:
            # a KHA checkpoint or a base checkpoint of a supported family; a reward model would get a random lm_head
            local_checkpoint = open_checkpoint(model_path, accept=_trainable, causal_lm=True)
    corpus = prepared_corpus(data)  # checked before anything else; raw text that would not fit in memory: refused
    record = run_record(corpus, data, seed, seq_len)
    if resume:  # the same destination rule as a plain run, and only a folder kha wrote is continued or replaced
        output_dir, adopt, checkpoint = resume_point(output_dir, [model_path, tokenizer], data)
        checkpoint = check_resumed_layout(adopt or output_dir, checkpoint, plan)
        if plan is None:  # a run sharded at load time keeps its states in kha's run state, checked above
            check_checkpoint_files(checkpoint, trust_checkpoint_pickle)
        check_random_states(checkpoint)  # every rank's, on every rank: a refusal is the same everywhere
        check_resumed_record(adopt or output_dir, record)  # the same corpus, seed and block length
        check_checkpoint_step(checkpoint, max_steps)
        replace = output_dir.exists()
    else:
        output_dir = check_run_destination(output_dir, [model_path, tokenizer], data, overwrite)
        check_no_interrupted_run(output_dir)  # its checkpoints are never deleted or left behind silently
        adopt, checkpoint, replace = None, None, overwrite
    documents = read_documents(data) if corpus is None else None  # bad data fails before anything is loaded
    dtype = torch.bfloat16 if bf16 else torch.float32
    # the tokenizer argument names it; from here on it is the object (train has no --trust-remote-code: never offered)
    if from_config:
        if tokenizer is None and corpus is None:
            raise KHAError(
                f"{model_path} is a config without a tokenizer: pass --tokenizer, or --data a prepared corpus"
            )
        tokenizer = load_tokenizer(tokenizer or corpus.folder / TOKENIZER_DIR, None, offer_trust=False)
        config = kha_config_from(model_path, knock, len(tokenizer))
        for key in ("bos_token_id", "eos_token_id"):  # the tokenizer's, as transformers would align
            setattr(config, key, getattr(tokenizer, key, None))  # them with a warning at the first save otherwise
        check_positions(config, seq_len)
        # counted on the meta device before the training arguments exist: under ZeRO-3 they make every model build
        # partitioned (deepspeed.zero.Init), the meta device's included
        model_bytes = check_model_fits(config, dtype)
    else:
        tokenizer = load_tokenizer(model_path, tokenizer, offer_trust=False)
        if local_checkpoint is not None:  # a Hub id is checked once loaded
            check_positions(local_checkpoint.config, seq_len)
    validation_set = None  # with eval_steps: evaluated while training; the held-out split only at the end
    if corpus is not None:
        train_set, heldout_set = corpus_splits(corpus, tokenizer, seq_len, max_eval_blocks)
        if eval_steps:
            validation_set = corpus.blocks("validation", seq_len, max_eval_blocks or MAX_PREPARED_EVAL_BLOCKS)
    elif eval_steps:  # raw text: the validation split is cut from before the held-out tail (which stays the same)
        train_set, validation_set, heldout_set = train_validation_heldout_split(
            documents, tokenizer, seq_len, max_eval_blocks=max_eval_blocks
        )
    else:
        train_set, heldout_set = train_heldout_split(documents, tokenizer, seq_len, max_heldout_blocks=max_eval_blocks)
    if validation_set is not None and len(validation_set) == 0:
        raise KHAError(f"the validation split holds less than one block of {seq_len} tokens: --eval-steps has nothing")
    # 0 steps is an error, before the model is loaded
    check_batches(len(train_set), batch_size, plan.data_parallel_size if plan else world_size())
    known_config = config if from_config else getattr(local_checkpoint, "model_config", None)
    layout_config = config if from_config else getattr(local_checkpoint, "config", None)
    if layout_config is not None:  # a Hub id's experts are known once loaded (transformers refuses there)
        check_plan_fits(plan, layout_config)
    if corpus is None and known_config is not None:
        check_token_ids(train_set, heldout_set, known_config)  # before the model loads: one line, nothing printed
    # before the model: under DeepSpeed ZeRO-3 (accelerate launch) the arguments switch transformers to build it
    # partitioned across ranks (deepspeed.zero.Init), as from_pretrained and from_config then do
    check_deepspeed_config()  # what accelerate hands this process: blocks that write elsewhere or end the run
    quiet_deepspeed_cpu_notice()
    hand_over_from_accelerate(plan)  # transformers shards the model: accelerate's FSDP plugin must not wrap it again
    if lr is None:  # new weights train at the preset's rate; a checkpoint at its mode's fine-tuning rate
        lr, origin = pretraining_lr(model_path, config) if from_config else (DEFAULT_LR[mode], f"--mode {mode}'s")
        origin += " default; --lr sets another"
    else:
        origin = "--lr"
    if is_main_process():
        print(f"learning rate {lr:g} ({origin}); schedule {schedule.describe(max_steps)}")
    args = paper_training_arguments(
        output_dir,  # replaced by the run's working folder below
        max_steps=max_steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        gradient_accumulation_steps=grad_accum,
        learning_rate=lr,
        bf16=bf16,
        activation_checkpointing=gradient_checkpointing,  # the current name (transformers >= 5.24)
        save_steps=save_steps or max(1, max_steps // 2),
        logging_steps=logging_steps or max(1, math.ceil(max_steps / 20)),
        seed=seed,
        data_seed=seed,
        report_to=report_to,
        disable_tqdm=disable_tqdm,
        # Trainer checkpoints no optimizer of a model sharded at load time: kha's run state does (run_state.py)
        save_only_model=plan is not None,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        **schedule_args,
    )
    build = None  # new weights under a parallel layout: built inside the run's working folder (below)
    if plan is not None and checkpoint is not None:  # the weights come sharded from the checkpoint itself
        model = _load(checkpoint, dtype, plan)
    elif from_config and plan is not None:
        build = partial(model_from_config, config, seed, dtype)
    elif from_config:
        model = model_from_config(config, seed, dtype)
    else:
        model = _load(model_path, dtype, plan)
    if not from_config:
        check_positions(model.config, seq_len)
    model_config = config if build is not None else model.config
    evaluated = [s for s in (heldout_set, validation_set) if s is not None]
    if corpus is not None:
        check_vocabulary_fits(corpus, model_config.get_text_config().vocab_size, train_set, *evaluated)
    elif known_config is None:  # a Hub id: its vocabulary is known once loaded
        check_token_ids(train_set, heldout_set, model_config)
    validation_note = f" / {len(validation_set)} validation" if validation_set is not None else ""
    if is_main_process():  # one line a run, not a rank
        print(f"data: {len(train_set)} train{validation_note} / {len(heldout_set)} held-out blocks of {seq_len} tokens")
    if build is None:
        check_lora_rank(model, lora_r, mode)
    if not from_config:
        model_bytes = weight_bytes(model)
    check_free_space(output_dir.parent, model_bytes + (1 << 20), "the trained model")

    if build is None:
        model = prepare_for_mode(model, mode, lora_r=lora_r)
    main = is_main_process()  # one line per run, not per rank
    # a finished run resumed into a new folder: one run at a time (a kept interrupted run is locked by its folder)
    locked = output_dir if resume and adopt is None and main else None
    with resume_lock(locked), run_output_dir(output_dir, replace, args, adopt=adopt) as work:
        if build is not None:  # built once and loaded as a checkpoint is, each rank its shard (training/parallel.py)
            model = prepare_for_mode(build_sharded(build, KHAForCausalLM, plan, work, dtype=dtype), mode)
        if main:
            print(model_line(model, tokenizer, model_path if from_config else None))
        trainer = KHATrainer(
            model=model,
            args=args,
            train_dataset=train_set,
            eval_dataset={"validation": validation_set} if validation_set is not None else heldout_set,
            processing_class=tokenizer,
            data_collator=default_data_collator,  # blocks are all seq_len long: nothing to pad, no pad token needed
            callbacks=[CheckpointCodeCallback(), StopOnNonFiniteLoss()],
            knock_lr=knock_lr,
            stability_every=logit_every or max(1, max_steps // 50),
            plan=plan,
            seq_len=seq_len,
            peak_flops=peak_flops,
        )
        trainer.fit_eval_batch(heldout_set)  # evaluated at the end, beside the validation split
        resumed_at = int(Path(checkpoint).name.rpartition("-")[2]) if checkpoint else None  # checkpoint-N
        trainer.resumed_from_step = resumed_at or 0
        if trainer.is_world_process_zero():
            write_run_record(work, record)  # what --resume checks: the same corpus, seed and block length
        # a finished run resumed: its records go on from the old folder's (their rows only, up to the checkpoint)
        earlier = output_dir if checkpoint and adopt is None else None
        if trainer.is_world_process_zero():
            stability_source = earlier / STABILITY_FILE if earlier is not None else None
            trainer.stability.append_to(work / STABILITY_FILE, resumed_at, stability_source)  # loss, norms, lr, logits
        if validation_set is not None:
            trainer.add_callback(
                ValidationRecord(
                    work / VALIDATION_FILE,
                    resumed_at,
                    trainer.is_world_process_zero(),
                    earlier / VALIDATION_FILE if earlier is not None else None,
                )
            )
        before = trainer.evaluate(heldout_set)["eval_loss"] if eval_before else None
        try:
            output = trainer.train(resume_from_checkpoint=checkpoint)
        except pickle.UnpicklingError as err:  # torch.load(weights_only=True) refused an object: nothing ran
            raise KHAError(f"cannot resume from {checkpoint}: {unpickling_reason(err)}") from err
        except SafetensorError as err:  # a checkpoint's weights whose header lies (a tensor past the file's end)
            if checkpoint is None or "deserializ" not in str(err).lower():
                raise  # a checkpoint that could not be written (a full disk): the output's own message, below
            raise KHAError(f"cannot resume from {checkpoint}: its weights cannot be read ({first_line(err)})") from err
        except SystemExit as err:  # a library ended the run (DeepSpeed's autotuning did): no model, never exit 0
            raise KHAError(f"training stopped before its last step (exit({err.code!r}) inside the trainer)") from None
        except (OSError, CheckpointException) as err:  # a checkpoint that could not be written (a full disk)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise KHAError(f"training stopped on a file error (a checkpoint in {work}?): {first[:300]}") from err
        metrics = trainer.evaluate(heldout_set)
        heldout = metrics["eval_loss"]
        trainer.save_state()  # trainer_state.json: the whole log history (validation losses included)
        output = output._replace(training_loss=output.metrics["train_loss"])  # the whole run's (KHATrainer.log)
        check_training_result(output.global_step, output.training_loss, heldout, model)  # keeps no bad model
        if trainer.is_world_process_zero():
            output.metrics.update(stability_metrics(iter_stability_lines(work / STABILITY_FILE), spike_margin))
        trainer.save_metrics("train", output.metrics)  # train_results.json, eval_results.json: as HF's examples do
        trainer.save_metrics("eval", metrics)
        adapter_dir = None
        if main:
            print(f"saving the trained model to {output_dir}")
        try:
            if mode == "lora":
                model.save_pretrained(work / "adapter")
                adapter_dir = output_dir / "adapter"
                model = model.merge_and_unload()  # a full KHA model with the trained knocks and merged LoRA deltas
            # a sharded model: every rank joins the gather (save_pretrained writes on the main process only)
            model.save_pretrained(work, is_main_process=plan is None or main)
            if plan is None or main:
                tokenizer.save_pretrained(work)
        except (OSError, SafetensorError) as err:  # a full disk ends here; safetensors' error is no OSError
            raise KHAError(f"cannot save the trained model to {output_dir}: {err}") from err
        if Path(model_path).is_dir() and not from_config:
            note = (
                f"Trained with `kha train --mode {mode}` for {output.global_step} steps of {batch_size * grad_accum} "
                f"x {seq_len} tokens; held-out loss {heldout:.4f}."
            )
            carry_training_card(Path(model_path), work, note)
    change = f" (before training: {before:.4f})" if before is not None else ""
    if main:
        print(f"train loss {output.training_loss:.4f}, held-out loss {heldout:.4f}{change}; saved to {output_dir}")
    return TrainResult(
        output_dir, output.training_loss, heldout, output.global_step, trainer.state.log_history, adapter_dir, before
    )


def model_line(model, tokenizer, config_ref=None) -> str:
    """'model: 12.9M parameters (...); vocabulary 49,152 from the tokenizer ./tok (cpu-tiny states 4,096)': the
    model as built, and where its vocabulary came from (new weights take the tokenizer's, whatever CONFIG_REF
    states)."""
    vocab = model.config.get_text_config().vocab_size
    name = getattr(tokenizer, "name_or_path", "") or "the run's"
    if config_ref is None:
        return f"model: {parameter_line(model)}; vocabulary {vocab:,} (the checkpoint's)"
    stated = stated_vocab_size(config_ref)
    note = f"; {config_ref} states {stated:,}" if stated is not None and stated != vocab else ""
    return f"model: {parameter_line(model)}; vocabulary {vocab:,} from the tokenizer {name}{note}"


def first_line(err: BaseException) -> str:
    """ERR's message up to any traceback it carries (torch DCP's CheckpointException holds every rank's), on one
    line of at most 400 characters."""
    text = str(err).split("Traceback (most recent call last)")[0]
    return " ".join(text.split())[:400] or type(err).__name__


def _load(source, dtype, plan):
    """The KHA model of SOURCE (a checkpoint), laid out by PLAN when there is one."""
    try:
        if plan is not None:
            return load_sharded(KHAForCausalLM, source, plan, dtype=dtype)
        return KHAForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError, CheckpointException) as err:  # DCP's is a BaseException (torch 2.13)
        raise KHAError(f"cannot load a KHA model from {source}: {first_line(err)}") from err


def check_checkpoint_step(checkpoint: str | None, max_steps: int) -> None:
    """One-line KHAError unless CHECKPOINT's trainer_state.json says the step its name says (`checkpoint-N`, as
    transformers names it), a step within MAX_STEPS: a tampered `global_step` of 10^12 "trained" a model in 0 s,
    one of -5 ran 11 steps where 2 were asked."""
    if checkpoint is None:
        return
    folder = Path(checkpoint)
    if folder.is_symlink():  # its weights, optimizer and random state would come from wherever it points
        raise KHAError(f"{folder} is a symbolic link: a run resumes from checkpoints it wrote itself")
    path = folder / "trainer_state.json"
    if path.is_symlink() or not path.is_file():
        raise KHAError(f"{folder} has no trainer_state.json (a regular file): not a checkpoint to resume from")
    from ..common.text_files import read_json_object

    step = read_json_object(path).get("global_step")
    named = folder.name.removeprefix("checkpoint-")
    if isinstance(step, bool) or not isinstance(step, int) or str(step) != named:
        raise KHAError(f"{path}: global_step {step!r} is not the step of {folder.name}: a changed checkpoint")
    if not 0 < step <= max_steps:
        raise KHAError(f"{folder.name} is at step {step}, past --max-steps {max_steps}: ask for more steps to resume")


def _resumable_checkpoint(folder: Path) -> str:
    """FOLDER's newest complete checkpoint, once nothing in FOLDER is a link or a FIFO (resume_files.py)."""
    check_run_entries(folder)
    checkpoint = last_complete_checkpoint(folder)
    if checkpoint is None:
        raise KHAError(f"nothing to resume: {folder} holds no complete checkpoint-N (with {TRAINER_STATE})")
    return checkpoint


def resume_point(
    output_dir: str | Path, models: list | None = None, data: list[str] | None = None
) -> tuple[Path, Path | None, str]:
    """(OUTPUT, kept folder to continue in or None, checkpoint to resume from) for `--resume`.

    OUTPUT passes the destination rule of a plain run (never the working directory, home, a root, MODELS or DATA,
    nor a folder holding them); an existing OUTPUT, which the new result replaces, must be one kha wrote. An
    interrupted run of OUTPUT (stopped by a signal, or SIGKILLed) kept its checkpoints in a `.kha-*.partial` sibling
    with kha's marker naming OUTPUT: the run continues there; a sibling that is a symbolic link, lacks the marker or
    whose process still runs is never adopted. A finished run resumes from OUTPUT's last checkpoint-N.
    """
    models = list(models or [])
    output_dir = check_run_destination(output_dir, models, data, overwrite=True)
    kept = resumable_partials(output_dir)
    if kept:
        folder = check_adoptable(kept[0], output_dir)
        check_run_place(folder, models, data)  # it is written to as well
        print(f"resuming the interrupted run kept in {folder}")
        return output_dir, folder, _resumable_checkpoint(folder)
    if output_dir.is_dir() and not output_dir.is_symlink() and is_training_run(output_dir):
        return output_dir, None, _resumable_checkpoint(output_dir)
    raise KHAError(f"nothing to resume: {output_dir} holds no checkpoint-N folders and no interrupted run of it")
