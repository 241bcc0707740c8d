"""`kha inspect`: how far each knock moved from its identity start, per layer, as a table, JSON or heatmaps.

For a knock matrix T (the map applied to head features; stored transposed as `weight`) with initial value T0
(I, or 0 for the MLP gate):
- distance: ‖T − T0‖_F
- mean_diag: mean of diag(T)
- offdiag_mass: Σ_{i≠j} |T_ij| / Σ |T_ij|  (0 for a diagonal matrix)
For MLP gates also their mean, std and max |value| (the gate is 2·sigmoid(V W_gate): 0 weights mean gate 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.knock_reader import KHACheckpoint, open_kha_checkpoint
from ..checkpoint.knock_tensors import KNOCK_KEY, KNOCK_PARTS
from ..common.errors import KHAError


def matrix_stats(weight: torch.Tensor, start: str) -> dict[str, float]:
    t = weight.double().T  # T itself
    eye = torch.eye(t.shape[0], dtype=t.dtype)
    initial = eye if start == "identity" else torch.zeros_like(t)
    total = t.abs().sum().item()
    off = (t * (1 - eye)).abs().sum().item()
    stats = {
        "distance": torch.linalg.norm(t - initial).item(),
        "mean_diag": t.diagonal().mean().item(),
        "offdiag_mass": off / total if total > 0 else 0.0,
    }
    if start == "zeros":
        stats.update(mean=t.mean().item(), std=t.std().item(), max_abs=t.abs().max().item())
    return stats


# every label a knock can have: a linear knock is its target, an MLP's or gate's maps are target.map
LABEL_ORDER = [label for t in "qkv" for label in (t, f"{t}.up", f"{t}.gate", f"{t}.down")]


def knock_matrices(kha: str | Path | KHACheckpoint) -> list[tuple[int, str, str, torch.Tensor]]:
    """(layer, label, initial value, weight) for every knock matrix of KHA (a folder, or the `KHACheckpoint` the
    caller opened); labels q / k / v / v.up / v.gate / v.down."""
    if not isinstance(kha, KHACheckpoint):
        kha = open_kha_checkpoint(kha)  # every matrix d_h x d_h, as the config says
    config = kha.config
    knocks = kha.read_knocks()  # finite: NaN statistics would print as a table and as invalid JSON
    found = []
    for name, tensor in knocks.items():
        match = KNOCK_KEY.match(name)
        target, part = match.group("target"), match.group("part")
        kind = getattr(config, f"knock_{target}")
        label = target if kind == "linear" else f"{target}.{part.removesuffix('.weight')}"
        found.append((int(match.group("layer")), label, dict(KNOCK_PARTS[kind])[part], tensor))
    return sorted(found, key=lambda item: (item[0], LABEL_ORDER.index(item[1])))


def knock_statistics(kha_dir: str | Path | KHACheckpoint) -> list[dict]:
    """One row per (layer, knock part): layer, knock (q / k / v / v.up / v.gate / v.down) and the stats."""
    return [
        {"layer": layer, "knock": label, **matrix_stats(weight, start)}
        for layer, label, start, weight in knock_matrices(kha_dir)
    ]


def format_table(rows: list[dict]) -> str:
    header = f"{'layer':>5}  {'knock':<7} {'‖T−T0‖_F':>9} {'mean diag':>9} {'off-diag':>8}  gate mean/std/max|.|"
    lines = [header, "-" * len(header)]
    for r in rows:
        gate = f"  {r['mean']:+.4f}/{r['std']:.4f}/{r['max_abs']:.4f}" if "mean" in r else ""
        numbers = f"{r['distance']:>9.4f} {r['mean_diag']:>9.4f} {r['offdiag_mass']:>8.4f}"
        lines.append(f"{r['layer']:>5}  {r['knock']:<7} {numbers}{gate}")
    return "\n".join(lines)


def knock_heatmaps(kha_dir: str | Path | KHACheckpoint) -> dict[tuple[str, int], torch.Tensor]:
    """(knock label, layer) -> T − T0, the matrix the heatmaps show (T itself: row i, column j is T[i, j])."""
    cells = {}
    for layer, label, start, weight in knock_matrices(kha_dir):
        t = weight.double().T  # nn.Linear stores T transposed
        cells[(label, layer)] = t - (torch.eye(t.shape[0], dtype=t.dtype) if start == "identity" else 0)
    return cells


def check_plot_path(path: str | Path) -> Path:
    """PATH if matplotlib can write its format (from the suffix), else a KHAError listing the formats."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if str(path).endswith(("/", "\\")):  # Path() would drop the slash and write a file the user called a folder
        raise KHAError(f"cannot write a plot to {path}: that names a folder; give a file name such as knocks.png")
    path = Path(path)
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise KHAError(f"cannot write a plot to {path}: use a file name ending in .{', .'.join(sorted(formats))}")
    if not path.parent.expanduser().is_dir():
        raise KHAError(f"cannot write a plot to {path}: the folder {path.parent} does not exist")
    return path


def plot_knocks(kha_dir: str | Path | KHACheckpoint, path: str | Path, max_layers: int | None = 8) -> Path:
    """A heatmap grid, rows = knocks, columns = layers (up to `max_layers`, evenly spaced; None: every layer):
    T − T0 per cell."""
    path = check_plot_path(path)
    import matplotlib.pyplot as plt

    cells = knock_heatmaps(kha_dir)
    name = (kha_dir.folder if isinstance(kha_dir, KHACheckpoint) else Path(kha_dir)).name
    knocks = sorted({k for k, _ in cells}, key=LABEL_ORDER.index)
    layers = sorted({layer for _, layer in cells})
    if max_layers is not None and len(layers) > max_layers:
        step = (len(layers) - 1) / (max_layers - 1)
        layers = sorted({layers[round(i * step)] for i in range(max_layers)})
    scale = max((v.abs().max().item() for v in cells.values()), default=0.0)
    fig, axes = plt.subplots(
        len(knocks), len(layers), figsize=(1.6 * len(layers) + 1, 1.6 * len(knocks) + 0.6), squeeze=False
    )
    image = None
    for i, knock in enumerate(knocks):
        for j, layer in enumerate(layers):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if (knock, layer) in cells:
                limit = scale or 1.0  # an untouched model: a blank (all-zero) map, not a division by zero
                image = ax.imshow(cells[(knock, layer)].numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit)
            if i == 0:
                ax.set_title(f"layer {layer}", fontsize=8)
            if j == 0:
                ax.set_ylabel(knock, fontsize=9)
    state = "minus their initial value (T − T0)" if scale > 0 else "all still at their initial value (T − T0 = 0)"
    shown = f"{len(layers)} of {len({layer for _, layer in cells})} layers"
    fig.suptitle(f"knocks of {name} {state}; {shown}", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def inspect(kha_dir: str | Path, plot: str | None = None, overwrite: bool = False, max_layers: int = 8, as_json=False):
    """`kha inspect`: print KHA_DIR's knock statistics (a table, or JSON), and with PLOT write the heatmaps there
    (atomically, never through a link, never inside KHA_DIR; MAX_LAYERS evenly spaced, 0 for all). The folder is
    read and checked once, for the table and the plot; PLOT's name and place are checked before any work."""
    import sys

    from ..checkpoint.output import atomic_output_file
    from ..checkpoint.paths import check_file_destination, check_place

    if plot:
        check_plot_path(plot)  # a bad name is a one-line error
        check_file_destination(plot, overwrite)  # no link written through, no file replaced unasked
        check_place(plot, [Path(kha_dir)])  # KHA_DIR is read-only: no plot inside it
    kha = open_kha_checkpoint(kha_dir)
    rows = knock_statistics(kha)
    print(json.dumps(rows, indent=2) if as_json else format_table(rows))
    if plot:
        with atomic_output_file(plot, overwrite=overwrite) as tmp:  # appears complete, or not at all
            plot_knocks(kha, tmp, max_layers=max_layers or None)
        print(f"wrote {plot}", file=sys.stderr if as_json else sys.stdout)
