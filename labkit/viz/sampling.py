"""Station 8 from real logits: the next-token distribution before and after labkit's own sampling
steps, and draws from labkit's own ``Sampler``.

Nothing here re-implements sampling. ``next_token_probs`` runs a row of logits through the same
functions ``Sampler.__call__`` uses, in its order: ``Penalties.apply`` (frequency, presence,
repetition), then ``filtered_probs`` (temperature, then top-k, top-p over the top-k-renormalized
distribution, min-p relative to the top token); ``sample_many`` calls ``Sampler`` itself, many times
over the same row, so a picture can be checked against real draws. ``check_filter`` checks a
learner's typical-p filter (notebook 12's Build-it) on fresh random logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.artist import Artist
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from labkit.sampling import Sampler, SamplingBatchInfo, SamplingParams
from labkit.sampling.sampler import filtered_probs
from labkit.viz import style
from labkit.viz.run import token_text

KEPT = style.STATION_COLORS[8]  # probability the sampler can draw (station 8's colour)
DROPPED = "#d9d9d9"  # a token a filter removed: its probability before the filter
RAW_TICK = "#222222"  # the model's own probability (temperature 1, no filter)
DRAWN = "#1d3557"  # how often the sampler really drew the token
REST = "#f4a261"  # all tokens outside the ones shown, together


@dataclass
class Row:
    """One request as the sampler sees it (labkit's ``SamplingReq``): its parameters and its
    token history, the prompt and the output so far (penalties read them)."""

    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)


def sampling_info(
    params: SamplingParams | Sequence[SamplingParams],
    vocab_size: int,
    *,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> SamplingBatchInfo:
    """The ``SamplingBatchInfo`` the scheduler would build for these requests (each with this
    history), after the same ``verify`` and ``normalize`` a request goes through on its way in.
    The parameters are copied: the caller's are not normalized in place."""
    rows = []
    for p in [params] if isinstance(params, SamplingParams) else params:
        p = dataclasses.replace(p)
        p.verify(vocab_size)
        rows.append(Row(p.normalize(), list(prompt_ids), list(output_ids)))
    return SamplingBatchInfo.from_requests(rows, vocab_size, "cpu", eos_token_ids=set())


def penalized_logits(
    logits: torch.Tensor, params: SamplingParams, *, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
) -> torch.Tensor:
    """A row of logits (``[vocab]``) after the request's penalties (``Penalties.apply``, as the
    sampler applies them first); the row itself when it uses none."""
    info = sampling_info(params, logits.shape[-1], prompt_ids=prompt_ids, output_ids=output_ids)
    row = logits.detach().float().reshape(1, -1)
    return (info.penalties.apply(row) if info.penalties is not None else row)[0]


def next_token_probs(
    logits: torch.Tensor, params: SamplingParams, *, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = ()
) -> torch.Tensor:
    """The distribution (``[vocab]``, summing to 1) that labkit's ``Sampler`` draws the next token
    of this request from: penalties, then ``filtered_probs`` (temperature, top-k, top-p, min-p),
    renormalized. A greedy request's is one-hot at the argmax of the penalized logits."""
    row = penalized_logits(logits, params, prompt_ids=prompt_ids, output_ids=output_ids)
    info = sampling_info(params, row.shape[0])
    if info.all_greedy:
        return torch.nn.functional.one_hot(row.argmax(), row.shape[0]).float()
    probs = filtered_probs(row.unsqueeze(0), info)[0]
    return probs / probs.sum()


def sample_many(
    logits: torch.Tensor,
    params: SamplingParams,
    n: int,
    *,
    seed: int = 0,
    chunk: int = 256,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
) -> torch.Tensor:
    """``n`` next tokens drawn by labkit's ``Sampler`` for the same row of logits: batches of
    ``chunk`` identical rows, the sampler's generator seeded with ``seed``. ``params.seed`` must be
    None (a request seed would give every row the same noise, hence the same token)."""
    if params.seed is not None:
        raise ValueError("sample_many draws independent tokens: give params without a seed")
    sampler = Sampler(seed=seed)
    row = logits.detach().float().reshape(1, -1)
    out = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        info = sampling_info([params] * m, row.shape[1], prompt_ids=prompt_ids, output_ids=output_ids)
        out.append(sampler(row.expand(m, -1), info).next_token_ids)
    return torch.cat(out)


Setting = SamplingParams | torch.Tensor  # sampling parameters, or a distribution already computed


def _distribution(logits: torch.Tensor, setting: Setting) -> torch.Tensor:
    if isinstance(setting, SamplingParams):
        return next_token_probs(logits, setting)
    probs = setting.detach().double().reshape(-1)
    return (probs / probs.sum()).float()


def filter_frame(logits: torch.Tensor, settings: Mapping[str, Setting]) -> pd.DataFrame:
    """One row per setting: the tokens it keeps (probability > 0), the share of the model's own
    distribution (temperature 1, no filter) they hold, the most likely token's probability, the
    distribution's entropy (nats) and how many tokens make up 90% of its mass."""
    model = torch.softmax(logits.detach().double().reshape(-1), -1)
    rows = []
    for name, setting in settings.items():
        p = _distribution(logits, setting).double()
        kept = p > 0
        nz = p[kept]
        ranked = torch.sort(p, descending=True).values.cumsum(0)
        rows.append(
            {
                "setting": name,
                "tokens kept": int(kept.sum()),
                "model mass kept": float(model[kept].sum()),
                "top token p": float(p.max()),
                "entropy (nats)": float(-(nz * nz.log()).sum()),
                "tokens for 90%": int((ranked < 0.9).sum()) + 1,
            }
        )
    return pd.DataFrame(rows).set_index("setting")


def _label(tokenizer: Any, token: int, limit: int = 10) -> str:
    text = token_text(tokenizer, [token], limit=limit) if tokenizer is not None else str(token)
    return text.replace(" ", "\u00b7")  # a visible space: most tokens start with one


def _grid(n: int, ncols: int | None, width: float, height: float) -> tuple[Figure, list[Any]]:
    """A grid of ``n`` panels, each about ``width`` x ``height`` inches (narrower where a row of
    them would pass 13 inches, about a notebook's width)."""
    ncols = ncols or (n if n <= 3 else 2)
    nrows = -(-n // ncols)
    fig = style.new_figure(min(width * ncols, 13.0), height * nrows)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def draw_distributions(
    logits: torch.Tensor,
    settings: Mapping[str, Setting],
    tokenizer: Any = None,
    *,
    n_tokens: int = 12,
    draws: Mapping[str, torch.Tensor] | None = None,
    ncols: int | None = None,
    title: str | None = None,
) -> Figure:
    """One panel per setting, over the same ``n_tokens`` tokens (the model's most likely, at
    temperature 1) and a last bar for all the others together: the probability the sampler draws
    each with (coloured; grey where the setting removed the token, at its probability before), a
    black tick at the model's own probability, and, for the settings in ``draws`` (token ids from
    ``sample_many``), a dot at how often the sampler drew it. Bars carry gid "kept", "dropped" or
    "rest"; dots "drawn"."""
    row = logits.detach().float().reshape(-1)
    vocab = row.shape[0]
    model = torch.softmax(row.double(), -1)
    top = torch.topk(model, n_tokens).indices
    shown = torch.zeros(vocab, dtype=torch.bool)
    shown[top] = True
    labels = [_label(tokenizer, int(t)) for t in top] + ["others"]
    x = np.arange(n_tokens + 1)
    fig, axes = _grid(len(settings), ncols, 0.42 * (n_tokens + 1) + 1.0, 2.9)
    ymax, any_dropped = 0.0, False
    for ax, (name, setting) in zip(axes, settings.items()):
        p = _distribution(row, setting).double()
        kept = p[top] > 0
        any_dropped |= not bool(kept.all())
        heights = torch.where(kept, p[top], model[top]).numpy()
        for i in range(n_tokens):
            ax.bar(
                x[i], heights[i], color=KEPT if kept[i] else DROPPED, width=0.75, gid="kept" if kept[i] else "dropped"
            )
        rest = float(p[~shown].sum())
        rest_kept = int((p[~shown] > 0).sum())
        ax.bar(x[-1], rest, color=REST, width=0.75, gid="rest")
        ax.text(x[-1], rest, f"{rest_kept:,}\nkept", ha="center", va="bottom", fontsize=6)
        model_heights = np.append(model[top].numpy(), float(model[~shown].sum()))
        ax.scatter(x, model_heights, marker="_", s=160, color=RAW_TICK, linewidths=1.2, zorder=3)
        if draws is not None and name in draws:
            ids = draws[name].reshape(-1)
            counts = torch.bincount(ids, minlength=vocab).double() / len(ids)
            observed = np.append(counts[top].numpy(), float(counts[~shown].sum()))
            ax.scatter(x, observed, marker="o", s=14, color=DRAWN, zorder=4, gid="drawn")
            ymax = max(ymax, float(observed.max()))
        ymax = max(ymax, float(heights.max()), rest, float(model_heights.max()))
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        n_kept = int((p > 0).sum())
        kept_text = f"all {vocab:,}" if n_kept == vocab else f"{n_kept:,} of {vocab:,}"
        ax.set_title(f"{name}\n{kept_text} tokens kept, top p = {float(p.max()):.2f}", fontsize=8.5)
        ax.tick_params(axis="y", labelsize=7)
        ax.spines[["top", "right"]].set_visible(False)
    for ax in axes:
        ax.set_ylim(0, ymax * 1.18)
    axes[0].set_ylabel("probability", fontsize=8)
    handles: list[Artist] = [Patch(facecolor=KEPT, label="the sampler draws it with this probability")]
    if any_dropped:
        handles.append(Patch(facecolor=DROPPED, label="removed (height: its probability before)"))
    handles += [
        Patch(facecolor=REST, label="all other tokens together"),
        Line2D([], [], marker="_", ls="none", color=RAW_TICK, markersize=10, label="the model's own probability"),
    ]
    if draws:
        handles.append(Line2D([], [], marker="o", ls="none", color=DRAWN, markersize=4, label="share of real draws"))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3), fontsize=7, frameon=False)
    if title:
        style.figure_title(fig, title)
    return fig


def draw_penalties(
    logits: torch.Tensor,
    settings: Mapping[str, SamplingParams],
    tokenizer: Any = None,
    *,
    prompt_ids: Sequence[int] = (),
    output_ids: Sequence[int] = (),
    n_tokens: int = 8,
    ncols: int | None = None,
    title: str | None = None,
) -> Figure:
    """One panel per setting: the logits of the model's ``n_tokens`` most likely tokens before
    (dashed outline) and after the setting's penalties (``Penalties.apply`` for a request with this
    prompt and output so far), the change written over each bar that moved. Each token is labelled
    with how often it occurs in the output (``×n``) and whether the prompt has it (``p``); the title
    names the token the penalized logits make most likely. The logit axis starts near the lowest
    value shown, so that differences of a unit or two are visible. Bars carry gid "penalized"."""
    row = logits.detach().float().reshape(-1)
    top = torch.topk(row, n_tokens).indices
    counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64), minlength=row.shape[0])
    in_prompt = set(prompt_ids)

    def label(t: int) -> str:
        marks = (f" ×{int(counts[t])}" if counts[t] else "") + (" p" if t in in_prompt else "")
        return _label(tokenizer, t) + marks

    x = np.arange(n_tokens)
    fig, axes = _grid(len(settings), ncols, 0.5 * n_tokens + 1.2, 2.8)
    shown = [row[top]]
    for ax, (name, params) in zip(axes, settings.items()):
        after = penalized_logits(row, params, prompt_ids=prompt_ids, output_ids=output_ids)
        shown.append(after[top])
        before_top, after_top = row[top].numpy(), after[top].numpy()
        ax.bar(x, before_top, width=0.75, facecolor="none", edgecolor=RAW_TICK, linewidth=0.8, ls="--")
        ax.bar(x, after_top, width=0.55, color=KEPT, gid="penalized")
        for xi, b, a in zip(x, before_top, after_top):
            if abs(a - b) > 1e-3:
                ax.text(xi, max(a, b), f"{a - b:+.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [label(int(t)) for t in top], rotation=60, ha="right", fontsize=7)
        best = int(after.argmax())
        ax.set_title(f"{name}\nmost likely now: {_label(tokenizer, best)}", fontsize=8.5)
        ax.tick_params(axis="y", labelsize=7)
        ax.spines[["top", "right"]].set_visible(False)
    lo = min(float(v.min()) for v in shown)
    hi = max(float(v.max()) for v in shown)
    margin = 0.15 * (hi - lo) + 0.5
    for ax in axes:
        ax.set_ylim(lo - margin, hi + margin)
    axes[0].set_ylabel("logit", fontsize=8)
    handles = [
        Patch(facecolor="none", edgecolor=RAW_TICK, ls="--", label="the model's logit"),
        Patch(facecolor=KEPT, label="after the penalties"),
        Patch(facecolor="none", edgecolor="none", label="×n: n times in the output so far;  p: in the prompt"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=7, frameon=False)
    if title:
        style.figure_title(fig, title)
    return fig


def check_filter(
    fn: Callable[[torch.Tensor, float], torch.Tensor],
    typical_p: float = 0.9,
    *,
    rows: int = 64,
    vocab: int = 50,
    seed: int = 0,
    tol: float = 1e-4,
) -> str:
    """Assert that ``fn(logits, typical_p)`` is locally typical sampling's filter on fresh random
    logits (``[rows, vocab]``, from nearly flat rows to very peaked ones): it returns a distribution
    per row (non-negative, summing to 1) without changing its input; the kept tokens keep their
    relative weights (the model's probabilities, renormalized); the kept set is a prefix of the
    tokens ordered by how far their surprise ``-log p`` is from the row's entropy ``H``; it holds at
    least ``typical_p`` of the mass, and without its farthest token it would not (the smallest such
    prefix). Returns a one-line summary; raises AssertionError naming the first property broken."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-1, 1.3, rows).unsqueeze(1)  # flat rows keep most tokens, peaked ones one
    logits = torch.randn(rows, vocab, generator=gen) * spread
    before = logits.clone()
    out = fn(logits, typical_p)
    assert torch.equal(logits, before), "the filter changed its input logits (work on a copy)"
    assert isinstance(out, torch.Tensor) and out.shape == logits.shape, (
        f"expected a tensor of shape {list(logits.shape)}, got {getattr(out, 'shape', type(out).__name__)}"
    )
    out = out.double()
    assert bool(torch.isfinite(out).all()) and bool((out >= 0).all()), (
        "probabilities must be finite and >= 0 (NaN: a row that keeps no token divides 0 by 0)"
    )
    sums = out.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=tol), (
        f"each row must sum to 1 (renormalize the kept tokens): row sums range {float(sums.min()):.4f} to "
        f"{float(sums.max()):.4f}"
    )
    model = torch.softmax(logits.double(), -1)
    surprise = -model.log()
    entropy = (model * surprise).sum(-1, keepdim=True)
    distance = (surprise - entropy).abs()
    kept = out > 0
    for r in range(rows):
        k = kept[r]
        ratio = out[r, k] / model[r, k]
        assert float(ratio.max() - ratio.min()) <= tol * float(ratio.mean()), (
            f"row {r}: the kept tokens must keep their relative weights (their probabilities, renormalized)"
        )
        if not bool(k.all()):
            assert float(distance[r, k].max()) <= float(distance[r, ~k].min()) + tol, (
                f"row {r}: a dropped token is closer to the entropy than a kept one (keep tokens in order of "
                f"|-log p - H|)"
            )
        mass = float(model[r, k].sum())
        assert mass >= typical_p - tol, f"row {r}: the kept tokens hold {mass:.3f} of the mass, < typical_p"
        farthest = float(model[r, k][distance[r, k].argmax()])
        assert mass - farthest < typical_p + tol, (
            f"row {r}: {int(k.sum())} tokens kept, but fewer would already reach typical_p (keep the smallest set)"
        )
    counts = kept.sum(-1)
    return (
        f"{getattr(fn, '__name__', 'the filter')}: all properties hold on {rows} random rows of {vocab} logits "
        f"(kept {int(counts.min())} to {int(counts.max())} tokens)"
    )
