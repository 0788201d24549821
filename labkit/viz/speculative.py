"""Speculative decoding: how many drafts each verify step kept, where the drafts and the target
parted, and the KV slots drafts borrowed and gave back, from the records of a traced run
(Engine(speculative_algorithm=..., enable_trace=True)).

What the records hold (labkit.trace.events): a TARGET_VERIFY step's StepRecord has `drafts` (rid ->
the drafts it verified, for each request that drafted), `accepted` (rid -> how many of them it
kept) and `rollback_slots` (KV slots allocated for rows whose tokens were not kept, given back in
the same step, page-rounded); the request's station-8 (SAMPLE) event of that step has detail
`draft` and `target`: the target's token at each of the request's rows (row j is the target's pick
after the drafts before it). A request that drafted d tokens and kept a of them gained a + 1 tokens:
the a drafts and the target's own token at row a (the one that replaced the first rejected draft, or
a bonus token when every draft was right). SGLang's `spec_accept_length` is the mean of a + 1 over
verify steps: the tokens one forward yields.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from labkit.trace.events import Station, StepRecord
from labkit.viz import style
from labkit.viz.run import Run, token_text

ACCEPTED = "#95d5b2"  # a draft the target agreed with
REJECTED = "#f28482"  # the first draft the target disagreed with
NOT_REACHED = "#e5e5e5"  # drafts after a rejected one: never compared
TARGET = "#ffffff"  # the target's own token that ends the run (edged in TARGET_EDGE)
TARGET_EDGE = "#1d3557"
DRAFTED = "#8d99ae"  # KV slots allocated for drafts
ROLLED_BACK = "#e76f51"  # KV slots given back
MEAN_LINE = "#222222"


def _verify_steps(source: Any) -> list[StepRecord]:
    """The run's steps in which some request drafted (ValueError when there are none)."""
    steps = [s for s in Run.of(source).steps if s.drafts]
    if not steps:
        raise ValueError(
            "no verify steps with drafts: trace a run with speculation, e.g. "
            "Engine(speculative_algorithm='ngram', enable_trace=True), on a prompt whose output repeats its input"
        )
    return steps


def draft_budget(source: Any) -> int:
    """The most drafts a request may take per step: the run's speculative_num_draft_tokens (from its
    engine config), else the most any verify step drafted."""
    run = Run.of(source)
    k = getattr(run.config, "speculative_num_draft_tokens", None)
    drafted = max((len(d) for s in run.steps for d in s.drafts.values()), default=0)
    return max(int(k), drafted) if k else drafted


def spec_frame(source: Any) -> pd.DataFrame:
    """One row per (verify step, request that drafted in it): step, rid, drafted (its drafts),
    accepted (drafts it kept), gained (accepted + 1: the drafts and the target's token after them),
    finished (the request finished in this step), rollback_slots (the step's KV slots given back,
    all its requests together: repeated on each of the step's rows, so sum it per step, e.g.
    `frame.groupby("step").rollback_slots.first().sum()`).

    `gained` is exact except where a stop condition (EOS, a stop string, max_new_tokens) fell inside
    the accepted run: the request kept the tokens up to the stop only (then `finished` is True, and
    gained may be as low as accepted). Sums of `drafted` and `accepted` over a request's rows equal
    its result's meta_info spec_draft_tokens and spec_accepted_tokens."""
    rows = [
        (s.step, rid, len(draft), s.accepted[rid], s.accepted[rid] + 1, rid in s.finished, s.rollback_slots)
        for s in _verify_steps(source)
        for rid, draft in s.drafts.items()
    ]
    columns = ["step", "rid", "drafted", "accepted", "gained", "finished", "rollback_slots"]
    return pd.DataFrame(rows, columns=columns)


def _rid_colors(rids: list[str]) -> dict[str, str]:
    return {rid: style.request_color(i) for i, rid in enumerate(dict.fromkeys(rids))}


def no_draft_steps(source: Any, rid: str) -> list[int]:
    """Steps in which `rid` decoded without drafting: paused after failed drafts, out of budget
    (max_new_tokens near), or its drafter found nothing to propose."""
    run = Run.of(source)
    drafted = {s.step for s in run.steps if rid in s.drafts}
    return [c.step for c in run.cells_of(rid) if c.phase == "decode" and c.step not in drafted]


def draw_accept_lengths(source: Any, *, title: str | None = None) -> Figure:
    """Accepted drafts per verify step, one marker line per request (Line2D gid "accepted:<rid>",
    broken where the request decoded without drafting in between); the steps in which it decoded
    without drafting as ticks on a "no drafts" row below 0 (gid "no-drafts:<rid>"); the mean over
    a step's drafting requests (gid "mean") when some step has several; and the draft budget k as a
    dashed reference (gid "budget"): a request on it kept every draft and gained k + 1 tokens from
    one forward."""
    run = Run.of(source)
    frame = spec_frame(run)
    k = draft_budget(run)
    rids = list(dict.fromkeys(frame.rid))
    colors = _rid_colors(rids)
    fig = style.new_figure(10, 3.6)
    ax = fig.subplots()
    below = -0.9  # the "no drafts" row
    for rid in rids:
        mine = frame[frame.rid == rid]
        idle = no_draft_steps(run, rid)
        xs: list[float] = []
        ys: list[float] = []
        for step, accepted in zip(mine.step, mine.accepted):
            if xs and any(xs[-1] < s < step for s in idle):
                xs.append(np.nan)  # a break in the line: it decoded without drafts in between
                ys.append(np.nan)
            xs.append(step)
            ys.append(accepted)
        ax.plot(xs, ys, marker="o", ms=4, lw=1.0, alpha=0.85, color=colors[rid], label=rid, gid=f"accepted:{rid}")
        if idle:
            ax.plot(idle, [below] * len(idle), ls="none", marker="|", ms=8, mew=1.2, color=colors[rid],
                    gid=f"no-drafts:{rid}")  # fmt: skip
    by_step = frame.groupby("step").accepted
    if (by_step.size() > 1).any():
        mean = by_step.mean()
        ax.plot(mean.index, mean.to_numpy(), color=MEAN_LINE, lw=1.2, ls=":", zorder=1, label="mean", gid="mean")
    ax.axhline(k, color="#999999", lw=0.9, ls="--", gid="budget")
    ax.annotate(f"budget k = {k}", (1.0, k), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                textcoords="offset points", ha="right", va="bottom", fontsize=8, color="#666666")  # fmt: skip
    ax.axhline(below / 2, color="#dddddd", lw=0.8)
    ax.set_ylim(below - 0.5, k + 0.8)
    ax.set_yticks([below, *range(k + 1)], ["no drafts", *map(str, range(k + 1))])
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("scheduler step")
    ax.set_ylabel("drafts accepted")
    legend = len(rids) <= len(style.REQUEST_PALETTE)
    if legend:
        ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=min(len(rids) + 1, 6), fontsize=8,
                  frameon=False, borderaxespad=0)  # fmt: skip
    mean_accepted = frame.accepted.mean()
    ax.set_title(
        title
        or f"Accepted drafts per verify step (mean {mean_accepted:.2f} of {frame.drafted.mean():.2f} drafted; "
        f"{mean_accepted + 1:.2f} tokens per forward)",
        loc="left",
        fontsize=10,
        pad=18 if legend else 6,
    )
    return fig


def draw_accept_histogram(source: Any, *, title: str | None = None) -> Figure:
    """How often a request's verify step kept 0, 1, ..., k drafts: one bar per count (k + 1 bars,
    gid "accepted"), labelled with its number of (step, request) pairs."""
    frame = spec_frame(source)
    k = draft_budget(source)
    counts = Counter(frame.accepted)
    xs = np.arange(k + 1)
    heights = [counts.get(int(x), 0) for x in xs]
    fig = style.new_figure(6, 3.2)
    ax = fig.subplots()
    colors = [ACCEPTED if x else REJECTED for x in xs]
    bars = ax.bar(xs, heights, color=colors, edgecolor="#555555", lw=0.6, gid="accepted")
    ax.bar_label(bars, fontsize=8, padding=2)
    ax.set_xticks(xs)
    ax.set_xlabel("drafts accepted in a verify step")
    ax.set_ylabel("(step, request) pairs")
    ax.set_ylim(0, max(heights) * 1.18 + 0.5)
    ax.set_title(
        title or f"Accepted drafts per verify step ({len(frame)} in all; 0 = first draft wrong, {k} = all right)",
        loc="left",
        fontsize=10,
    )
    return fig


def draw_spec_kv(source: Any, *, title: str | None = None) -> Figure:
    """Per verify step: KV slots allocated for drafts (the step's drafted tokens, every request
    together; bars gid "drafted") next to the slots given back in the same step
    (`rollback_slots`, gid "rolled-back"). Every drafting request also took one slot for its last
    token, which it always keeps, and with page_size > 1 slots go in and out by pages (a page the
    request still writes to stays its own), so the two bars compare only with page_size 1 exactly:
    there given back = drafted - accepted (plus, for a request a stop cut short, the slots after it)."""
    steps = _verify_steps(source)
    xs = np.array([s.step for s in steps])
    drafted = np.array([sum(len(d) for d in s.drafts.values()) for s in steps])
    rolled = np.array([s.rollback_slots for s in steps])
    accepted = np.array([sum(s.accepted.values()) for s in steps])
    fig = style.new_figure(10, 3.2)
    ax = fig.subplots()
    width = 0.4
    ax.bar(xs - width / 2, drafted, width, color=DRAFTED, label="slots for drafts", gid="drafted")
    ax.bar(xs + width / 2, rolled, width, color=ROLLED_BACK, label="given back (rollback)", gid="rolled-back")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("scheduler step (verify steps only)")
    ax.set_ylabel("KV slots")
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=2, fontsize=8, frameon=False, borderaxespad=0)
    ax.set_title(
        title
        or f"KV slots per verify step: {drafted.sum()} for drafts, {accepted.sum()} of them kept, "
        f"{rolled.sum()} given back",
        loc="left",
        fontsize=10,
        pad=18,
    )
    return fig


@dataclass
class DraftRun:
    """One verify step of one request, from its station-8 record."""

    step: int
    draft: list[int]
    target: list[int]  # the target's token at each row: len(draft) + 1 of them

    @property
    def accepted(self) -> int:
        """Leading drafts equal to the target's token at their row (what verification keeps)."""
        a = 0
        while a < len(self.draft) and self.draft[a] == self.target[a]:
            a += 1
        return a


def draft_runs(source: Any, rid: str) -> list[DraftRun]:
    """The verify steps in which `rid` drafted, in order, with its drafts and the target's tokens
    (from the SAMPLE station events' `draft` and `target` details)."""
    out = []
    for e in Run.of(source).tracer.events:
        if e.rid == rid and e.station == Station.SAMPLE and e.detail.get("draft"):
            draft = [t for t in e.detail["draft"] if isinstance(t, int)]  # the recorder may cut long lists
            target = [t for t in e.detail["target"] if isinstance(t, int)]
            out.append(DraftRun(int(e.step or 0), draft, target))
    if not out:
        raise ValueError(f"{rid!r} drafted in no recorded verify step (is it a request of this traced run?)")
    return sorted(out, key=lambda r: r.step)


def draw_drafts(
    source: Any,
    rid: str,
    *,
    tokenizer: Any = None,
    steps: tuple[int, int] | None = None,
    max_chars: int = 10,
    title: str | None = None,
) -> Figure:
    """The request's drafts against the target's choices, token by token: one row per verify step
    in which it drafted (`steps`: first, last; default all), one cell per draft, coloured accepted
    (the target picked the same token at that row), rejected (the first it did not) or not reached
    (after a rejection: never compared); then, in the last column, the target's own token at the
    first row that differed (it replaced the rejected draft) or after the last draft (a bonus
    token, when all were right). Cells show decoded text with `tokenizer` (default: the run's, if
    it has one; `max_chars` per cell; a space shows as ·), else token ids. Rectangles carry gid
    "accepted", "rejected", "not-reached" or "target".

    The colours say what verification found; where a stop condition fell inside an accepted run,
    the request kept only the tokens up to it (spec_frame's `accepted` counts those)."""
    run = Run.of(source)
    tokenizer = tokenizer if tokenizer is not None else run.tokenizer
    records = draft_runs(run, rid)
    if steps is not None:
        records = [r for r in records if steps[0] <= r.step <= steps[1]]
        if not records:
            raise ValueError(f"{rid!r} drafted in none of the steps {steps[0]}..{steps[1]}")
    k = max(draft_budget(run), max(len(r.draft) for r in records))

    def label(token: int) -> str:
        text = token_text(tokenizer, [token], limit=max_chars) if tokenizer is not None else str(token)
        return text.replace(" ", "\u00b7")  # a visible space: most tokens start with one

    cell_w, gap = 1.0, 0.35
    fig = style.new_figure(1.05 * (k + 1) + 2.2, 0.32 * len(records) + 1.3)
    ax = fig.subplots()
    for y, r in enumerate(records):
        a = r.accepted
        for j, token in enumerate(r.draft):
            kind = "accepted" if j < a else "rejected" if j == a else "not-reached"
            color = {"accepted": ACCEPTED, "rejected": REJECTED, "not-reached": NOT_REACHED}[kind]
            ax.add_patch(Rectangle((j, y + 0.06), cell_w - 0.06, 0.88, facecolor=color, edgecolor="none", gid=kind))
            ax.text(j + 0.47, y + 0.5, label(token), ha="center", va="center", fontsize=7,
                    color="#888888" if kind == "not-reached" else "#111111", parse_math=False)  # fmt: skip
        x = k + gap
        ax.add_patch(Rectangle((x, y + 0.06), cell_w - 0.06, 0.88, facecolor=TARGET, edgecolor=TARGET_EDGE, lw=1.0,
                               gid="target"))  # fmt: skip
        if a < len(r.target):
            ax.text(x + 0.47, y + 0.5, label(r.target[a]), ha="center", va="center", fontsize=7, weight="bold",
                    color=TARGET_EDGE, parse_math=False)  # fmt: skip
        ax.text(-0.12, y + 0.5, f"step {r.step}: {a}/{len(r.draft)}", ha="right", va="center", fontsize=7)
    ax.set_xlim(-0.05, k + gap + cell_w + 0.05)
    ax.set_ylim(len(records), 0)
    ax.set_xticks([j + 0.47 for j in range(k)] + [k + gap + 0.47])
    ax.set_xticklabels([f"draft {j + 1}" for j in range(k)] + ["target"], fontsize=8)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [
        Patch(facecolor=ACCEPTED, label="accepted"),
        Patch(facecolor=REJECTED, label="rejected (the target chose otherwise)"),
        Patch(facecolor=NOT_REACHED, label="not reached"),
        Patch(facecolor=TARGET, edgecolor=TARGET_EDGE, label="the target's token that ends the run"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, 0.0), ncols=2, fontsize=7, frameon=False)
    kept = sum(r.accepted for r in records)
    drafted = sum(len(r.draft) for r in records)
    style.figure_title(
        fig, title or f"{rid}: drafts against the target, {kept} of {drafted} accepted in {len(records)} verify steps"
    )
    return fig
