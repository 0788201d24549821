"""Mixture of experts: how many tokens the router sent to each expert, step by step, from the step
records of a traced run of a MoE model (StepRecord.expert_tokens: [MoE layer][expert], global expert
ids). `layer` is the MoE layer's index, the row of that record: decoder layer
`model.moe_layer_ids[layer]`. The load-imbalance factor of a layer in a step is the busiest expert's
tokens over the mean per expert: 1.0 is perfectly even; with expert parallelism the busiest expert's
rank sets the pace of the layer.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from labkit.trace.events import StepRecord
from labkit.viz import style
from labkit.viz.run import Run

EXPERT_CMAP = "YlGnBu"


def _moe_steps(source: Any) -> list[StepRecord]:
    """The run's step records that carry expert counts (ValueError when none do)."""
    steps = [s for s in Run.of(source).steps if s.expert_tokens is not None]
    if not steps:
        raise ValueError(
            "no expert-load records: trace a run of a mixture-of-experts model "
            "(Engine(model_path='tiny-qwen3-moe', enable_trace=True)); dense models record none"
        )
    return steps


def expert_load(source: Any, layer: int | None = None) -> pd.DataFrame:
    """One row per step x MoE layer (only `layer` if given) x expert: step, forward_mode, num_tokens
    (the step's tokens), layer, expert, tokens (routed to it; a layer's rows sum to num_tokens x top_k)."""
    return _load_frame(_moe_steps(source), layer)


def _load_frame(steps: list[StepRecord], layer: int | None) -> pd.DataFrame:
    rows = [
        (s.step, s.forward_mode, s.num_tokens, li, e, n)
        for s in steps
        for li, counts in enumerate(s.expert_tokens or [])
        if layer is None or li == layer
        for e, n in enumerate(counts)
    ]
    columns = ["step", "forward_mode", "num_tokens", "layer", "expert", "tokens"]
    if not rows:
        raise ValueError(f"no MoE layer {layer} in this run's expert records")
    return pd.DataFrame(rows, columns=columns)


def load_imbalance(source: Any, over: Literal["step", "run"] = "step") -> pd.DataFrame:
    """The load-imbalance factor max / mean tokens per expert. over="step": one row per step and MoE
    layer (step, forward_mode, num_tokens, layer, max_tokens, mean_tokens, busiest, imbalance);
    over="run": one row per layer, its tokens summed over the run's steps (then num_tokens is the
    run's total). NaN where a layer routed nothing."""
    if over not in ("step", "run"):
        raise ValueError(f"over must be 'step' or 'run', not {over!r}")
    steps = _moe_steps(source)
    load = _load_frame(steps, None)
    if over == "run":
        load = load.groupby(["layer", "expert"], as_index=False)["tokens"].sum()
        load["num_tokens"] = sum(s.num_tokens for s in steps)
    keys = ["step", "forward_mode", "num_tokens", "layer"] if over == "step" else ["layer", "num_tokens"]
    grouped = load.groupby(keys, sort=False)["tokens"]
    out = grouped.agg(max_tokens="max", mean_tokens="mean").reset_index()
    out["busiest"] = load.loc[grouped.idxmax(), "expert"].to_numpy()
    out["imbalance"] = out.max_tokens / out.mean_tokens.where(out.mean_tokens > 0)
    return out[[*keys, "max_tokens", "mean_tokens", "busiest", "imbalance"]]


def draw_expert_load(source: Any, layer: int = 0, steps: tuple[int, int] | None = None) -> Figure:
    """Tokens routed to each expert of MoE layer `layer` per step (`steps`: first, last; default
    all): a heatmap (AxesImage gid "expert-load", array [expert, step]) with a colorbar, and below it
    the step's imbalance factor (Line2D gid "imbalance"; the even 1.0 is gid "even")."""
    records = _moe_steps(source)
    if steps is not None:
        records = [s for s in records if steps[0] <= s.step <= steps[1]]
    if not records:
        raise ValueError(f"no expert-load records in steps {steps}")
    num_layers = len(records[0].expert_tokens or [])
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be a MoE layer index in [0, {num_layers}), got {layer}")
    counts = np.array([(s.expert_tokens or [])[layer] for s in records]).T  # [expert, step]
    mean = counts.mean(axis=0)
    imbalance = np.divide(counts.max(axis=0), mean, out=np.full(len(records), np.nan), where=mean > 0)
    step_ids = [s.step for s in records]

    fig = style.new_figure(10, 5.2)
    grid = fig.add_gridspec(2, 2, width_ratios=[60, 1], height_ratios=[3, 1.2])  # the colorbar's column
    heat = fig.add_subplot(grid[0, 0])
    line = fig.add_subplot(grid[1, 0], sharex=heat)
    image = heat.imshow(counts, aspect="auto", cmap=EXPERT_CMAP, interpolation="nearest", origin="lower")
    image.set_gid("expert-load")
    fig.colorbar(image, cax=fig.add_subplot(grid[0, 1]), label="tokens routed")
    heat.tick_params(labelbottom=False)
    heat.set_ylabel("expert")
    heat.yaxis.set_major_locator(MaxNLocator(integer=True))
    line.plot(range(len(records)), imbalance, color="#222222", lw=1.2, gid="imbalance")
    for mode in dict.fromkeys(s.forward_mode for s in records):
        xs = [i for i, s in enumerate(records) if s.forward_mode == mode]
        color = style.MODE_COLORS.get(mode, style.MODE_COLORS["IDLE"])
        line.scatter(xs, imbalance[xs], s=14, color=color, zorder=3, label=mode.lower())
    line.axhline(1.0, color="#999999", lw=0.8, ls="--", gid="even")
    line.set_ylim(bottom=0.9)  # the factor is never below 1
    line.set_ylabel("max / mean")
    line.set_xlabel("scheduler step")
    modes = len({s.forward_mode for s in records})  # the legend above the panel, right
    line.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=modes, fontsize=8, frameon=False, borderaxespad=0)
    line.xaxis.set_major_locator(MaxNLocator(integer=True))
    line.xaxis.set_major_formatter(FuncFormatter(lambda x, _: str(step_ids[int(x)]) if 0 <= x < len(step_ids) else ""))
    total = counts.sum(axis=1)
    overall = total.max() / max(total.mean(), 1e-12)
    style.figure_title(
        fig, f"Tokens per expert, MoE layer {layer} (the steps drawn together: max / mean = {overall:.2f})"
    )
    return fig
