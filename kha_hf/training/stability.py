"""Training stability, measured per step: the loss, the global and the knocks' gradient norms, the learning rate, and
every K steps the largest attention logit of each layer; and the loss-spike count behind the paper's "more stable
training dynamics" (Zhou et al. 2025, its 1T-token run: "far fewer loss spikes").

The largest attention logit is `max q·k · scaling` over the positions a query may attend (after q/k norms and RoPE,
before any soft cap), per layer, over the whole batch. It is read where transformers hands query and key to the
attention kernel: `KHATrainer` runs the model on an attention implementation registered with transformers under
its own name (`AttentionInterface.register`, the documented extension point), which calls transformers' SDPA
function unchanged and, on a probed step only, computes the logits' maximum on the side in chunks. Models on
another implementation (eager-only families such as Gemma 2) record no logits; every other column still is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..common.text_files import bounded_lines, keep_rows

PROBE_IMPLEMENTATION = "kha_logit_probe"
STABILITY_FILE = "stability.jsonl"  # kha train's per-step rows, in its output folder
PROBED_IMPLEMENTATION = "sdpa"
MAX_ROW_BYTES = 1 << 20  # a row holds a number a layer: far past any model's
_CHUNK_ELEMENTS = 1 << 24  # logits computed per chunk (64 MiB in float32): memory stays flat in T


@dataclass
class StabilityLog:
    """What one training run recorded, one row per optimizer step, the logits every `logit_every` steps: in `rows`,
    or appended to `path` instead (kha train: a run of millions of steps keeps none of them in memory)."""

    logit_every: int
    rows: list[dict] = field(default_factory=list)
    path: Path | None = None

    def append_to(self, path: Path, keep_until: int | None = None, source: Path | None = None) -> None:
        """Append every row to PATH from now on. The rows already there, or SOURCE's (a finished run's record, when
        it is resumed into a new folder), are kept up to step KEEP_UNTIL (a resumed run's checkpoint: the steps after
        it run again; None keeps every step); lines that are not rows are dropped, streaming through a sibling file,
        so the file holds each step once, in order, and nothing but rows is ever copied."""
        keep_rows(path, iter_stability_lines, keep_until, source)
        self.path = path

    _loss: float = 0.0
    _norms: tuple[float | None, float | None] = (None, None)
    _logits: dict[int, float] = field(default_factory=dict)
    probing: bool = False

    def mean_loss(self) -> float | None:
        """The mean step loss of the whole run: over the rows of its record (a resumed run's include the steps
        before its checkpoint), or, without a file, over the rows kept here. None when nothing was recorded."""
        total, count = 0.0, 0  # streamed: memory flat in the run's length
        for row in iter_stability_lines(self.path) if self.path is not None else self.rows:
            if isinstance(row.get("loss"), (int, float)):
                total, count = total + row["loss"], count + 1
        return total / count if count else None

    def wants_logits(self, step: int) -> bool:
        """Whether optimizer step STEP (1-based) measures the attention logits: the first, then every K-th."""
        return self.logit_every > 0 and (step == 1 or step % self.logit_every == 0)

    def add_loss(self, loss: float) -> None:
        self._loss += loss

    def set_norms(self, global_norm: float | None, knock_norm: float | None) -> None:
        self._norms = (global_norm, knock_norm)

    def record_logit(self, layer: int, value: float) -> None:
        self._logits[layer] = max(value, self._logits.get(layer, -math.inf))

    def end_step(self, step: int, lr: float | None) -> None:
        """Close optimizer step STEP. Collective in a run of several processes (every rank calls it, as Trainer's
        callbacks do): the row is the run's, not rank 0's."""
        self._loss, self._logits = _across_ranks(self._loss, self._logits)
        row = {
            "step": step,
            "loss": self._loss,
            "grad_norm": self._norms[0],
            "knock_grad_norm": self._norms[1],
            "lr": lr,
        }
        if self._logits:
            row["max_logit"] = [self._logits[i] for i in sorted(self._logits)]
        if self.path is None:
            self.rows.append(row)
        else:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, allow_nan=True) + "\n")
        self._loss, self._norms, self._logits, self.probing = 0.0, (None, None), {}, False


def _across_ranks(loss: float, logits: dict[int, float]) -> tuple[float, dict[int, float]]:
    """The run's step loss and largest logits from each rank's: the loss is the mean over ranks (what Trainer logs:
    it gathers every rank's loss and averages), each layer's logit the maximum over ranks. Under DDP and FSDP2 each
    rank trained on its own share of the global batch; the global norms are already the run's (whole gradients)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return loss, logits
    layers = sorted(logits)
    values = torch.tensor([loss, *(logits[i] for i in layers)], dtype=torch.float64)
    # one all-reduce each; the device is the process group's (gloo: CPU, nccl: the rank's GPU)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    summed, largest = values[:1].to(device), values[1:].to(device)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    if layers:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    loss = summed.item() / dist.get_world_size()
    return loss, dict(zip(layers, largest.cpu().tolist(), strict=True))


_ACTIVE: list[StabilityLog] = []  # the run whose step is being probed (at most one: a process trains one model)


def probed_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention (query (B, H, T, d), key/value (B, H_kv, S, d)), recording the largest logit of
    MODULE's layer first when a step is probed (no gradient: the measurement does not touch training)."""
    log = _ACTIVE[-1] if _ACTIVE else None
    if log is not None and log.probing and module.training:
        scaling = kwargs.get("scaling")
        scaling = scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
        log.record_logit(int(getattr(module, "layer_idx", 0) or 0), largest_logit(query, key, attention_mask, scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.no_grad()
def largest_logit(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> float:
    """max over batch, heads and allowed (query, key) pairs of `q·k · scaling`. MASK: transformers' SDPA mask (bool,
    True = attend, (B or 1, 1, T, S)), an additive float mask, or None (causal). Chunked over batch x heads."""
    batch, heads, length, _ = query.shape
    groups = heads // key.shape[1]
    if mask is None:
        allowed = torch.ones(length, key.shape[2], dtype=torch.bool, device=query.device).tril(key.shape[2] - length)
        mask = allowed[None, None]
    best = -math.inf
    per_head = length * key.shape[2]
    step = max(1, _CHUNK_ELEMENTS // per_head)
    for b in range(batch):
        m = mask[b if mask.shape[0] > 1 else 0]  # (1 or H, T, S)
        for h in range(0, heads, step):
            q = query[b, h : h + step].float()
            k = key[b, torch.arange(h, min(h + step, heads), device=key.device) // groups].float()
            logits = (q @ k.transpose(-1, -2)) * scaling  # (h, T, S)
            logits = logits.masked_fill(~m, -math.inf) if m.dtype == torch.bool else logits + m.float()
            best = max(best, logits.max().item())
    return best


def _configs(model) -> list:
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None)
    return [c for c in (config, None if text is config else text) if c is not None]


def start_probing(model, log: StabilityLog) -> bool:
    """Run MODEL's attention through the probe for the run LOG records; False (nothing changed) when the model does
    not run on SDPA or no logit is asked for."""
    configs = _configs(model)
    _ACTIVE.clear()  # a run that ended in an exception left its log here: it probes nothing any more
    accepted = (PROBED_IMPLEMENTATION, PROBE_IMPLEMENTATION)  # the probe's own name: a failed run's, taken back
    if log.logit_every <= 0 or not configs or any(c._attn_implementation not in accepted for c in configs):
        stop_probing(model, log)
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    # the probing attention, and SDPA's mask under the same name
    AttentionInterface.register(PROBE_IMPLEMENTATION, probed_attention)
    AttentionMaskInterface.register(PROBE_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS[PROBED_IMPLEMENTATION])
    for config in configs:
        config._attn_implementation = PROBE_IMPLEMENTATION
    _ACTIVE.append(log)
    return True


def stop_probing(model, log: StabilityLog) -> None:
    """Give MODEL its SDPA attention back (saved checkpoints name `sdpa`, never the probe)."""
    for config in _configs(model):
        if config._attn_implementation == PROBE_IMPLEMENTATION:
            config._attn_implementation = PROBED_IMPLEMENTATION
    if log in _ACTIVE:
        _ACTIVE.remove(log)


def gradient_norm(parameters) -> float | None:
    """The 2-norm of the gradients of PARAMETERS (those that have one), in float32; None when none has one."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    whole = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]  # FSDP2/TP: every rank calls this
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in whole])).item()


def stability_callback(trainer):
    """A TrainerCallback filling TRAINER.stability: probes at the start of a measured step, closes each step with
    the learning rate it used, and starts/stops the attention probe around training."""
    from transformers import TrainerCallback

    from .params import is_knock_parameter

    log: StabilityLog = trainer.stability

    class _Callback(TrainerCallback):
        lr = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.probed = start_probing(trainer.model, log)
            return control

        def on_step_begin(self, args, state, control, **kwargs):
            log.probing = self.probed and log.wants_logits(state.global_step + 1)
            return control

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            log.probing = False
            if log._norms == (None, None):  # no clipping (max_grad_norm 0): the gradients are still whole
                model = trainer.model
                knocks = [p for n, p in model.named_parameters() if is_knock_parameter(n)]
                log.set_norms(gradient_norm(model.parameters()), gradient_norm(knocks))
            self.lr = optimizer.param_groups[0]["lr"] if optimizer is not None else None
            return control

        def on_step_end(self, args, state, control, **kwargs):
            log.end_step(state.global_step, self.lr)
            return control

        def on_train_end(self, args, state, control, **kwargs):
            stop_probing(trainer.model, log)
            return control

    return _Callback()


def _number(value, nullable: bool = True) -> bool:
    if value is None:
        return nullable
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_stability_row(row) -> bool:
    """Whether ROW is what `StabilityLog.end_step` writes: a positive integer step, a loss (a number, or null for a
    NaN kept as strict JSON), norms and a learning rate that are numbers or null, logits a list of numbers."""
    if not isinstance(row, dict) or set(row) - {"step", "loss", "grad_norm", "knock_grad_norm", "lr", "max_logit"}:
        return False
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1 or "loss" not in row:
        return False
    if not all(_number(row.get(key)) for key in ("loss", "grad_norm", "knock_grad_norm", "lr")):
        return False
    logits = row.get("max_logit", [])
    return isinstance(logits, list) and all(_number(v, nullable=False) for v in logits)


def iter_stability_lines(path: Path) -> Iterator[dict]:
    """The rows a run appended to PATH, streamed, each step once and in order (a row whose step is not past the
    previous one is skipped). A line that is not a row (cut by an interruption, edited, not UTF-8) is skipped: the
    records describe the run, they never stop it."""
    if not path.is_file() or path.is_symlink():
        return
    last = 0
    with open(path, "rb") as f:
        for raw in bounded_lines(f, MAX_ROW_BYTES):  # a row is a few KB: a planted 1 GiB line is never held
            try:
                row = json.loads(raw.decode("utf-8", errors="replace"))
            except ValueError:
                continue
            if is_stability_row(row) and row["step"] > last:
                last = row["step"]
                yield row


def read_stability_lines(path: Path) -> list[dict]:
    """`iter_stability_lines` as a list (for short runs and tests)."""
    return list(iter_stability_lines(path))


def stability_metrics(rows: Iterable[dict], margin: float) -> dict:
    """What a run's train_results.json carries of ROWS (`is_stability_row` each, streamed once): the spike count and
    the largest norms and logit."""
    from .spikes import count_spikes

    largest: dict[str, float | None] = dict.fromkeys(("grad_norm", "knock_grad_norm", "max_logit"))

    def losses():
        for row in rows:
            for key in largest:
                value = row.get(key)
                for v in value if isinstance(value, list) else [value]:
                    if isinstance(v, (int, float)) and math.isfinite(v) and (largest[key] is None or v > largest[key]):
                        largest[key] = v
            yield math.nan if row["loss"] is None else row["loss"]

    spikes = count_spikes(losses(), margin=margin)
    return {
        "loss_spikes": spikes,
        "spike_margin": margin,
        "max_grad_norm": largest["grad_norm"],
        "max_knock_grad_norm": largest["knock_grad_norm"],
        "max_attention_logit": largest["max_logit"],
    }
