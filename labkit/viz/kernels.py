"""Views and checks of notebook 07 (kernels).

Split-KV decode (kernels/decode.py): `split_partials` computes what stage 1 of decode_attention
computes for one request, in plain torch (each split's max score, sum of exponentials and partial
output), `draw_split_kv` draws it with the merge, and `check_merge` checks a merge written by the
learner against torch's softmax attention on fresh random inputs. `draw_paged_addressing` draws how
a decode kernel finds a request's KV: its row of req_to_token, the slots, the pages they lie in.

The GPU figures read the results file of `python -m labkit.bench.kernels_report` (`load_gpu_results`);
each is titled with the device and command the file records."""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from labkit.viz import style

if TYPE_CHECKING:  # torch is imported where it is used: `import labkit.viz` stays light
    import torch

# One colour per KV split (none of them the decode green or the prefill blue of style.MODE_COLORS).
SPLIT_COLORS = ["#e76f51", "#2a9d8f", "#8d6cab", "#e9c46a", "#b56576", "#6d597a", "#bc6c25", "#1d3557"]
EAGER, GRAPH, FLOOR, TORCH = "#b56576", "#2a9d8f", "#444444", "#8d99ae"
# Where labkit.bench.kernels_report writes by default (its RESULTS_FILE; not imported from there, as
# that module pulls in the engine), and the variable that points the notebook at another file.
RESULTS_FILE = Path(__file__).resolve().parents[2] / "data" / "results" / "kernels_gpu.json"
RESULTS_ENV = "LABKIT_KERNELS_RESULTS"


def split_color(i: int) -> str:
    return SPLIT_COLORS[i % len(SPLIT_COLORS)]


# ---- split-KV decode ---------------------------------------------------------------------------
def split_bounds(seq_len: int, num_splits: int) -> list[tuple[int, int]]:
    """[start, end) of each split, by stage 1's rule: splits of ceil(seq_len / num_splits) tokens,
    the last one shorter, or empty when the others already cover everything."""
    size = -(-seq_len // num_splits)
    return [(min(s * size, seq_len), min((s + 1) * size, seq_len)) for s in range(num_splits)]


@dataclass
class SplitPartials:
    """What stage 1 computes for one request, per split s and query head h (natural-log units)."""

    bounds: list[tuple[int, int]]  # [start, end) of each split
    scores: torch.Tensor  # [H, L] float64: q . k * sm_scale of every KV token
    m: torch.Tensor  # [S, H] the largest score in the split (-inf if empty)
    sumexp: torch.Tensor  # [S, H] sum over the split of exp(score - m) (0 if empty)
    o: torch.Tensor  # [S, H, D] the split's softmax over its own tokens applied to V (0 if empty)
    reference: torch.Tensor  # [H, D] softmax attention over all L tokens (float64)


def split_partials(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int, sm_scale: float
) -> SplitPartials:
    """One request's split-KV partials: q [H, D], k and v [L, H_kv, D] (query head h reads KV head
    h // (H / H_kv)), computed in float64 so that they serve as a reference for the kernel's."""
    import torch

    num_heads = q.shape[0]
    group = num_heads // k.shape[1]
    kh = k.double().repeat_interleave(group, dim=1)  # [L, H, D]
    vh = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), kh) * sm_scale
    bounds = split_bounds(k.shape[0], num_splits)
    m = torch.full((num_splits, num_heads), -math.inf, dtype=torch.float64)
    sumexp = torch.zeros(num_splits, num_heads, dtype=torch.float64)
    o = torch.zeros(num_splits, num_heads, q.shape[1], dtype=torch.float64)
    for s, (start, end) in enumerate(bounds):
        if end > start:
            m[s] = scores[:, start:end].max(dim=1).values
            p = torch.exp(scores[:, start:end] - m[s][:, None])
            sumexp[s] = p.sum(dim=1)
            o[s] = torch.einsum("hl,lhd->hd", p, vh[start:end]) / sumexp[s][:, None]
    reference = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=1), vh)
    return SplitPartials(bounds, scores, m, sumexp, o, reference)


MergeFn = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor"], "torch.Tensor"]

# (KV tokens, splits, query heads, KV heads, head dim, score scale): the cases check_merge runs.
MERGE_CASES = [
    (37, 1, 2, 1, 8, 1.0),  # one split: the merge must give its partial back
    (200, 4, 9, 3, 16, 1.0),  # SmolLM2's heads, four even splits
    (101, 3, 4, 2, 16, 1.0),  # uneven: 34 + 34 + 33 tokens
    (5, 4, 2, 2, 8, 1.0),  # splits of 2: the last split is empty (max -inf, sumexp 0, partial 0)
    (64, 4, 4, 1, 16, 40.0),  # large scores: exp(max) overflows float32 unless the largest max is taken out
]


def check_merge(merge: MergeFn, seed: int | None = None) -> pd.DataFrame:
    """Check merge(m, sumexp, o) -> out [H, D] on fresh random inputs: per case of MERGE_CASES,
    random q, K, V (float32), their split partials (m [S, H], sumexp [S, H], o [S, H, D], float32,
    as split_partials computes them), and the merge's output against torch's softmax attention over
    all the tokens. Raises AssertionError naming the first case that is wrong; returns a table of
    the cases and their errors."""
    import torch

    seed = random.randrange(2**31) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for seq_len, splits, heads, kv_heads, dim, scale in MERGE_CASES:
        q = torch.randn(heads, dim, generator=gen) * scale
        k = torch.randn(seq_len, kv_heads, dim, generator=gen)
        v = torch.randn(seq_len, kv_heads, dim, generator=gen)
        parts = split_partials(q, k, v, splits, dim**-0.5)
        case = f"{seq_len} tokens in {splits} split(s), {heads} heads" + (f", scores x{scale:g}" if scale != 1 else "")
        out = merge(parts.m.float(), parts.sumexp.float(), parts.o.float())
        assert isinstance(out, torch.Tensor), f"{case}: merge returned {type(out).__name__}, not a tensor"
        assert tuple(out.shape) == (heads, dim), f"{case}: output shape {tuple(out.shape)}, expected ({heads}, {dim})"
        assert torch.isfinite(out).all(), f"{case}: the output has inf or NaN (did an exp overflow?)"
        err = (out.double() - parts.reference).abs().max().item()
        assert err < 1e-4, f"{case}: output differs from softmax attention by up to {err:.3g}"
        rows.append({"case": case, "max |merge - softmax attention|": err})
    return pd.DataFrame(rows)


def draw_split_kv(
    parts: SplitPartials,
    out: torch.Tensor,
    head: int = 0,
    dims: int = 8,
    title: str | None = None,
) -> Figure:
    """One query head's split-KV decode: the scores of every KV token, shaded by split, with each
    split's max (top); each split's share of the softmax, sumexp_s * exp(m_s - M) over their sum
    (bottom left); the first `dims` coordinates of each split's partial output, their plain mean,
    the merged output `out` [H, D] (the kernel's) and softmax attention over all tokens (bottom right)."""
    import torch

    m, z, o = parts.m[:, head], parts.sumexp[:, head], parts.o[:, head, :dims]
    top = m.max()  # some split is never empty
    weights = torch.where(z > 0, z * torch.exp(m - top), torch.zeros_like(z))
    share = (weights / weights.sum()).tolist()
    scores = parts.scores[head].numpy()
    fig = style.new_figure(12, 6.6)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.15, 1], width_ratios=[1, 1.5])
    ax = fig.add_subplot(grid[0, :])
    for s, (start, end) in enumerate(parts.bounds):
        if end <= start:
            continue
        c = split_color(s)
        ax.axvspan(start - 0.5, end - 0.5, color=c, alpha=0.08)
        ax.bar(range(start, end), scores[start:end], width=1.0, color=c, alpha=0.75)
        ax.hlines(float(m[s]), start - 0.5, end - 0.5, colors=c, linestyles="--", lw=1.2)
        at = start + int(np.argmax(scores[start:end]))
        ax.plot([at], [float(m[s])], "v", color=c, ms=6)
        ax.text(
            (start + end) / 2,
            1.0,
            f"split {s}: tokens {start}-{end - 1}\nmax m = {float(m[s]):.2f}, sumexp = {float(z[s]):.2f}",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=8,
            color=c,
        )
    ax.axhline(0, color="#999999", lw=0.5)
    ax.set_xlim(-0.5, scores.shape[0] - 0.5)
    ax.set_xlabel("KV token position in the request", fontsize=8)
    ax.set_ylabel(f"score of head {head}\n(q · k × sm_scale)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(
        title or f"Split-KV decode of one request, head {head}: every split is one program of stage 1",
        loc="left",
        fontsize=10,
        weight="bold",
        pad=30,
    )

    ax_w = fig.add_subplot(grid[1, 0])
    names = [f"split {s}" for s in range(len(parts.bounds))]
    ax_w.barh(names, share, color=[split_color(s) for s in range(len(names))])
    for s, w in enumerate(share):
        ax_w.text(w + 0.01, s, f"{w:.2f}", va="center", fontsize=8)
    ax_w.invert_yaxis()
    ax_w.set_xlim(0, 1.15)
    ax_w.set_xlabel("weight in the merge: sumexp·exp(m - max m), normalized", fontsize=8)
    ax_w.tick_params(labelsize=7)
    ax_w.set_title("The merge: how much each split counts", loc="left", fontsize=9, weight="bold")

    ax_o = fig.add_subplot(grid[1, 1])
    x = np.arange(o.shape[1])
    for s in range(len(names)):
        if float(z[s]) > 0:
            ax_o.plot(x, o[s].numpy(), "o", color=split_color(s), ms=4, alpha=0.8, label=f"partial o of split {s}")
    ax_o.plot(x, o[z > 0].mean(0).numpy(), "^", color="#999999", ms=6, label="plain mean of the partials (wrong)")
    ax_o.plot(x, parts.reference[head, :dims].numpy(), "o", mfc="none", mec="black", ms=11, label="softmax attention")
    ax_o.plot(x, out[head, :dims].double().cpu().numpy(), "x", color="black", ms=8, mew=2, label="merged (kernel)")
    ax_o.set_xticks(x, [f"d{i}" for i in x], fontsize=7)
    ax_o.tick_params(labelsize=7)
    ax_o.set_xlabel(f"the first {dims} coordinates of head {head}'s output", fontsize=8)
    ax_o.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax_o.set_title("Partial outputs, and their weighted merge", loc="left", fontsize=9, weight="bold")
    return fig


# ---- paged addressing --------------------------------------------------------------------------
def draw_paged_addressing(
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    page_size: int,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """A decode batch as the kernel addresses it. Top: for batch row b, row req_pool_indices[b] of
    req_to_token, positions 0..seq_lens[b]-1, each cell holding the token's KV slot; lines at page
    boundaries. Bottom: the pool's slots page by page (a column per page, a row per offset in the
    page), each slot the batch reads coloured by its request and labelled with the position it
    holds; page 0 is the reserved page, grey slots are not read by this batch."""
    labels = list(labels or [f"row {b}" for b in range(len(seq_lens))])
    slots = [req_to_token[r, :n].tolist() for r, n in zip(req_pool_indices, seq_lens)]
    last_page = max((s // page_size for row in slots for s in row), default=0)
    num_pages = last_page + 2  # one unread page after the last one in use
    n_pos = max(seq_lens)
    fig = style.new_figure(12, 1.2 + 0.45 * len(slots) + 0.32 * page_size + 1.4)
    ax_t, ax_p = fig.subplots(2, 1, height_ratios=[0.45 * len(slots) + 0.6, 0.32 * page_size + 0.9])
    owner: dict[int, tuple[int, int]] = {}  # slot -> (batch row, position)
    for b, row in enumerate(slots):
        for pos, slot in enumerate(row):
            owner[slot] = (b, pos)
            ax_t.add_patch(Rectangle((pos, b - 0.3), 1, 0.6, facecolor=style.request_color(b), edgecolor="white"))
            ax_t.text(pos + 0.5, b, str(slot), ha="center", va="center", fontsize=6.5, color="white")
        for start in range(0, len(row), page_size):  # the page each run of page_size positions lies in
            mid = start + min(page_size, len(row) - start) / 2
            ax_t.text(mid, b - 0.33, f"page {row[start] // page_size}", ha="center", va="bottom", fontsize=6.5)
    for x in range(0, n_pos + 1, page_size):
        ax_t.axvline(x, color="#333333", lw=0.6, alpha=0.6)
    ax_t.set_xlim(0, n_pos)
    ax_t.set_ylim(len(slots) - 0.5, -0.6)
    ax_t.set_xticks([p + 0.5 for p in range(n_pos)], [str(p) for p in range(n_pos)], fontsize=6.5)
    ticks = [f"{lab}: req_to_token[{r}]" for lab, r in zip(labels, req_pool_indices)]
    ax_t.set_yticks(range(len(slots)), ticks, fontsize=8)
    for tick, b in zip(ax_t.get_yticklabels(), range(len(slots))):
        tick.set_color(style.request_color(b))
    ax_t.set_xlabel(f"token position (lines: page boundaries, page_size {page_size})", fontsize=8)
    ax_t.tick_params(axis="x", length=0)
    ax_t.set_title(
        title or "req_to_token: the KV slot of every token of the batch's requests (number in the cell)",
        loc="left",
        fontsize=10,
        weight="bold",
    )

    for page in range(num_pages):
        for off in range(page_size):
            slot = page * page_size + off
            if page == 0:
                face, text, color = style.RESERVED, "", "white"
            elif slot in owner:
                b, pos = owner[slot]
                face, text, color = style.request_color(b), str(pos), "white"
            else:
                face, text, color = style.FREE, "", "black"
            ax_p.add_patch(Rectangle((page, off), 1, 1, facecolor=face, edgecolor="white", lw=0.8))
            if text:
                ax_p.text(page + 0.5, off + 0.5, text, ha="center", va="center", fontsize=6.5, color=color)
    ax_p.set_xlim(0, num_pages)
    ax_p.set_ylim(page_size, 0)
    ax_p.set_xticks([p + 0.5 for p in range(num_pages)], [str(p) for p in range(num_pages)], fontsize=7)
    ax_p.set_yticks([o + 0.5 for o in range(page_size)], [f"+{o}" for o in range(page_size)], fontsize=7)
    ax_p.set_xlabel("page (slot = page × page_size + offset)", fontsize=8)
    ax_p.set_ylabel("offset", fontsize=8)
    ax_p.set_title(
        "The pool, page by page: each slot the batch reads, labelled with the token position it holds",
        loc="left",
        fontsize=10,
        weight="bold",
    )
    handles = [Patch(color=style.request_color(b), label=lab) for b, lab in enumerate(labels)]
    handles += [Patch(color=style.RESERVED, label="page 0: reserved"), Patch(color=style.FREE, label="not read")]
    ax_p.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7.5, frameon=False)
    return fig


# ---- the GPU results file ----------------------------------------------------------------------
def results_path() -> Path:
    """$LABKIT_KERNELS_RESULTS if set, else data/results/kernels_gpu.json of this checkout."""
    return Path(os.environ.get(RESULTS_ENV) or RESULTS_FILE)


def load_gpu_results(path: str | Path | None = None) -> dict[str, Any] | None:
    """The benchmark's results (labkit.bench.kernels_report), or None when the file is missing."""
    path = Path(path) if path is not None else results_path()
    return json.loads(path.read_text()) if path.is_file() else None


def recorded_by(results: dict[str, Any]) -> str:
    """'recorded on <device> by `<command>`', from the file's own metadata."""
    meta = results["meta"]
    return f"recorded on {meta['device']} by `{meta['command']}`"


def graph_steps_frame(results: dict[str, Any]) -> pd.DataFrame:
    """Median forward and step milliseconds per batch size and mode (graph / eager), with the padded
    size each batch replays (NaN above the largest captured size, where both run eagerly)."""
    steps = pd.DataFrame(results["cuda_graphs"]["steps"])
    frame = steps.groupby(["batch_size", "mode"]).agg(
        padded_size=("padded_size", "first"),
        forward_ms=("forward_ms", "median"),
        step_ms=("step_ms", "median"),
        steps=("forward_ms", "size"),
    )
    return frame.reset_index()


def draw_graph_steps(results: dict[str, Any]) -> Figure:
    """Decode forward time (and whole step time, dashed) against batch size, replayed from a CUDA
    graph and eager, from the recorded steps; dotted lines at the captured batch sizes."""
    graphs = results["cuda_graphs"]
    frame = graph_steps_frame(results)
    fig = style.new_figure(11, 4.4)
    ax = fig.subplots()
    max_bs = graphs["max_bs"]
    sizes = sorted(frame.batch_size.unique())
    for bs in graphs["capture_batch_sizes"]:
        if bs <= max(sizes):
            ax.axvline(bs, color="#cccccc", lw=0.7, ls=":", zorder=0)
    if max(sizes) > max_bs:
        ax.axvspan(max_bs, max(sizes) * 1.15, color="#eeeeee", zorder=0)
        ax.text(math.sqrt(max_bs * max(sizes) * 1.15), 0.03, f"above {max_bs}: both eager",
                transform=ax.get_xaxis_transform(), rotation=90, ha="center", va="bottom", fontsize=7,
                color="#555555")  # fmt: skip
    for mode, color, label in (("eager", EAGER, "eager"), ("graph", GRAPH, "graph replay")):
        rows = frame[frame["mode"] == mode]
        ax.plot(rows.batch_size, rows.forward_ms, "o-", color=color, ms=4, label=f"{label}: the forward")
        ax.plot(rows.batch_size, rows.step_ms, "--", color=color, lw=1, label=f"{label}: the whole scheduler step")
    for _, r in frame[(frame["mode"] == "graph") & (frame.padded_size > frame.batch_size)].iterrows():
        ax.annotate(
            f"{r.batch_size}→{int(r.padded_size)}",
            (r.batch_size, r.forward_ms),
            xytext=(0, -11),
            textcoords="offset points",
            ha="center",
            fontsize=6.5,
            color=GRAPH,
        )
    ax.set_xscale("log", base=2)
    labelled: list[int] = []  # sizes too close on the log axis (16, 17) share one label
    for size in sizes:
        if not labelled or math.log2(size / labelled[-1]) > 0.2:
            labelled.append(size)
    ax.set_xticks(labelled, [str(s) for s in labelled], fontsize=7)
    ax.minorticks_off()
    ax.set_xlim(min(sizes) / 1.15, max(sizes) * 1.15)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("decode batch size (dotted: captured sizes; n→p: a batch of n replayed the graph of p)", fontsize=8)
    ax.set_ylabel("median milliseconds", fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    ax.set_title(
        f"{results['meta']['engine_model']} decode steps, graph replay vs eager"
        + ("" if graphs["replay"] == "CUDA graph replay" else f" (graph: {graphs['replay']})")
        + "\n"
        + recorded_by(results),
        loc="left",
        fontsize=9.5,
        weight="bold",
    )
    return fig


def _case_label(r: pd.Series) -> str:
    return f"B={r.batch} L={r.seq_len}"


def draw_decode_roofline(results: dict[str, Any]) -> Figure:
    """Decode attention against its floor (K and V read once at the measured copy bandwidth): the
    achieved fraction per case (left), and at batch 1 the time against the bound on splits (right)."""
    decode = pd.DataFrame(results["decode_attention"])
    splits = pd.DataFrame(results["decode_splits"])
    bw = results["ceilings"]["copy_bytes_per_s"]
    fig = style.new_figure(12, 4.6)
    ax_f, ax_s = fig.subplots(1, 2, width_ratios=[1.3, 1])
    models = list(dict.fromkeys(decode.model))
    width = 0.8 / len(models)
    cases = list(dict.fromkeys(decode.apply(_case_label, axis=1)))
    for i, model in enumerate(models):
        rows = decode[decode.model == model]
        x = [cases.index(_case_label(r)) + (i - (len(models) - 1) / 2) * width for _, r in rows.iterrows()]
        r0 = rows.iloc[0]
        label = f"{model} ({r0.num_heads} q / {r0.num_kv_heads} kv heads of {r0.head_dim})"
        bars = ax_f.bar(x, rows.fraction, width=width * 0.95, color=split_color(i), label=label)
        for bar, (_, r) in zip(bars, rows.iterrows()):
            ax_f.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01, f"{r.fraction:.0%}\n{r.ms:.3g} ms",
                      ha="center", va="bottom", fontsize=6.5)  # fmt: skip
    ax_f.set_xticks(range(len(cases)), cases, fontsize=7.5)
    ax_f.set_ylim(0, max(1.0, decode.fraction.max() * 1.25))
    ax_f.axhline(1.0, color=FLOOR, lw=0.8, ls="--")
    ax_f.set_ylabel("floor time / kernel time", fontsize=8)
    ax_f.tick_params(axis="y", labelsize=7)
    ax_f.set_xlabel(f"batch B, KV tokens per request L (page_size {decode.page_size.iloc[0]})", fontsize=8)
    ax_f.legend(fontsize=7, frameon=False, loc="upper left")
    ax_f.set_title(
        f"Decode attention: fraction of the copy bandwidth ({bw / 1e12:.2f} TB/s measured)",
        loc="left",
        fontsize=9,
        weight="bold",
    )
    for i, model in enumerate(dict.fromkeys(splits.model)):
        rows = splits[splits.model == model]
        ax_s.plot(rows.max_kv_splits, rows.ms, "o-", color=split_color(i), ms=4, label=f"{model}")
        ax_s.axhline(rows.floor_ms.iloc[0], color=split_color(i), lw=0.8, ls="--")
    r0 = splits.iloc[0]
    same_case = decode[(decode.batch == r0.batch) & (decode.seq_len == r0.seq_len)]
    for pick in sorted(set(same_case.max_kv_splits)):  # what decode_kv_splits chose for this case
        ax_s.axvline(pick, color="#999999", lw=0.8, ls=":")
        ax_s.text(pick, 0.02, " decode_kv_splits' pick", transform=ax_s.get_xaxis_transform(), rotation=90,
                  va="bottom", ha="right", fontsize=7, color="#555555")  # fmt: skip
    ax_s.set_xscale("log", base=2)
    ax_s.set_yscale("log")
    ticks = sorted(splits.max_kv_splits.unique())
    ax_s.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax_s.minorticks_off()
    ax_s.tick_params(axis="y", labelsize=7)
    ax_s.set_xlabel("splits per request (stage-1 programs = splits × KV heads)", fontsize=8)
    ax_s.set_ylabel("kernel time (ms, log; dashed: floor)", fontsize=8)
    ax_s.legend(fontsize=7, frameon=False)
    ax_s.set_title(
        f"One request of {r0.seq_len} tokens: time against the number of splits", loc="left", fontsize=9, weight="bold"
    )
    style.figure_title(fig, "Decode attention: " + recorded_by(results), fontsize=9)
    return fig


def draw_fused_kernels(results: dict[str, Any]) -> Figure:
    """rmsnorm, fused_add_rmsnorm and rotary_embedding, a panel each: per model and token count, the
    Triton kernel, its plain-PyTorch reference (several kernels) and the floor (bytes read and
    written at the copy bandwidth), with the kernel's fraction of the floor and its speed-up."""
    frame = pd.DataFrame(results["norm_rotary"])
    kernels = list(dict.fromkeys(frame.kernel))
    cases = list(dict.fromkeys(zip(frame.model, frame.tokens)))
    fig = style.new_figure(13, 0.5 * len(cases) + 1.9)
    axes = fig.subplots(1, len(kernels), sharey=True, squeeze=False)[0]
    y, h = np.arange(len(cases)), 0.27
    lo, hi = frame.floor_ms.min() / 2, max(frame.torch_ms.max(), frame.ms.max()) * 150
    for ax, kernel in zip(axes, kernels):
        rows = frame[frame.kernel == kernel].set_index(["model", "tokens"]).reindex(cases)
        ax.barh(y - h, rows.ms, height=h, color=GRAPH, label="Triton kernel")
        ax.barh(y, rows.torch_ms, height=h, color=TORCH, label="plain PyTorch (kernels/reference.py)")
        ax.barh(y + h, rows.floor_ms, height=h, color=FLOOR, label="floor: bytes / copy bandwidth")
        for i, (_, r) in enumerate(rows.iterrows()):
            note = f"{r.fraction:.0%} of floor\ntorch {r.torch_ms / r.ms:.1f}x slower"
            ax.text(max(r.ms, r.torch_ms) * 1.3, i, note, va="center", fontsize=6.5)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_xlabel("milliseconds (log)", fontsize=8)
        ax.set_title(kernel, loc="left", fontsize=9, weight="bold")
    names = [f"{model}\n{tokens} token{'s' if tokens != 1 else ''}" for model, tokens in cases]
    axes[0].set_yticks(y, names, fontsize=7)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize=7.5, frameon=False)
    style.figure_title(fig, "Fused norm and rotary kernels: " + recorded_by(results), fontsize=9)
    return fig
