"""Packed batches: how the tokens of several requests become one forward, read from a real step.

`record_forwards(engine)` watches the engine's ModelRunner while the `with` block is open: it wraps
`build_forward_batch`, `forward` and the attention backend's `forward` of that one instance (and
puts them back on exit; the engine's code and state are unchanged), and keeps a `PackedStep` per
forward: a copy of the ForwardBatch fields the attention backend reads, each request's
req_to_token row as it stood, the logits, and one layer's attention inputs and output.

    with record_forwards(engine) as forwards:
        engine.step()
    step = forwards[-1]
    step.token_frame(tokenizer)           # one row per packed token: request, position, out_cache_loc
    draw_packed_batch(step, tokenizer)    # the packed row, and a padded batch of the same requests
    draw_req_to_token(step)               # each request's req_to_token row: cached prefix, new slots
    draw_attention_mask(step)             # query tokens x KV slots: block-diagonal, causal per request
    attention_errors(step, step.mask())   # attention with a mask, per token, against the backend's output
    padding_cost(step)                    # what a padded batch of the same requests would compute
    check_positions(fn, step); check_attention_mask(fn, step)   # a learner's fn against the real forward

The attention contract (labkit/attention/base.py): token t of request i, at position p, reads the KV
of request i at positions 0..p (its cached prefix through req_to_token, and the new tokens up to
itself), nothing of other requests. Over the KV slots a batch reads, that is a mask with one block
per request, causal within it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from labkit.model_executor.forward_batch import ForwardBatch, ForwardMode
from labkit.viz import style
from labkit.viz.run import token_text

PAD = "#d9d9d9"  # a padded batch's pad tokens
NOT_READ = "#ffffff"
PREFIX_ALPHA = 0.3  # a request's cached prefix: its colour, lightened
OWN_EDGE = "#111111"  # the query token's own KV slot (its out_cache_loc)
SHARED_TEXT = "#d08c00"  # the number of a slot two requests read (a shared prefix), in amber


@dataclass
class LayerCapture:
    """One layer's attention in a recorded forward: the backend's inputs and output, and the K and V
    of every KV slot the batch reads (`PackedStep.kv_slots`, in that order) as the pool held them
    right after the layer wrote the new tokens' KV."""

    layer_id: int
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    out: torch.Tensor  # [num_tokens, num_heads * head_dim]: the backend's result
    k: torch.Tensor  # [len(kv_slots), num_kv_heads, head_dim]
    v: torch.Tensor
    scaling: float


@dataclass
class PackedStep:
    """A copy of one forward's ForwardBatch, as the attention backend reads it. Row i is a request
    (for TARGET_VERIFY, one of its rows); `prefix_lens` and `extend_lens` are the backend's view: in a
    DECODE forward every row extends its sequence by one token (prefix = seq_len - 1)."""

    forward_mode: str
    rids: list[str]
    input_ids: list[int]  # [num_tokens]: every row's new tokens, one after the other, no padding
    positions: list[int]  # [num_tokens]: each new token's position in its own sequence
    out_cache_loc: list[int]  # [num_tokens]: the KV slot each new token's K and V are written to
    req_pool_indices: list[int]  # [batch_size]: each row's row of req_to_token
    seq_lens: list[int]  # [batch_size]: each sequence's length after this forward
    prefix_lens: list[int]
    extend_lens: list[int]
    req_to_token: list[list[int]]  # row i: req_to_token[req_pool_indices[i], :seq_lens[i]]
    tokens: list[list[int]]  # row i: the token ids at positions 0..seq_lens[i]-1
    logits: torch.Tensor  # [batch_size, vocab]: next-token logits of each row's last token
    layer: LayerCapture | None = None  # None when that layer ran inside a CUDA graph

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def kv_slots(self) -> list[int]:
        """Every KV slot the forward reads, once each, in the order of the rows of req_to_token (a
        prefix slot shared by two requests is listed where the first of them reads it)."""
        return unique_slots(self.req_to_token)

    @property
    def token_rows(self) -> list[int]:
        """The batch row (request) of each packed token."""
        return [i for i, n in enumerate(self.extend_lens) for _ in range(n)]

    def mask(self, slots: Sequence[int] | None = None) -> torch.Tensor:
        """The attention mask the backend applies, [num_tokens, len(slots)] bool, over `slots`
        (default: `kv_slots`)."""
        return attention_mask(self.prefix_lens, self.extend_lens, self.req_to_token, slots or self.kv_slots)

    def token_frame(self, tokenizer: Any = None) -> pd.DataFrame:
        """One row per packed token: its request, text, input id, position and out_cache_loc."""
        rows = self.token_rows
        return pd.DataFrame(
            {
                "rid": [self.rids[i] for i in rows],
                "token": [token_text(tokenizer, [t]) for t in self.input_ids],
                "input_id": self.input_ids,
                "position": self.positions,
                "out_cache_loc": self.out_cache_loc,
            }
        ).rename_axis("packed index")

    def request_frame(self) -> pd.DataFrame:
        """One row per batch row: its request, req_to_token row, prefix, new tokens and sequence
        length, and the rows of the packed input it owns."""
        starts = np.cumsum([0, *self.extend_lens])
        return pd.DataFrame(
            {
                "rid": self.rids,
                "req_pool_idx": self.req_pool_indices,
                "prefix_len": self.prefix_lens,
                "extend_len": self.extend_lens,
                "seq_len": self.seq_lens,
                "packed rows": [f"{a}..{b - 1}" for a, b in zip(starts[:-1], starts[1:])],
            }
        )


def unique_slots(rows: Sequence[Sequence[int]]) -> list[int]:
    """The slots of `rows`, each once, in order of first appearance."""
    return list(dict.fromkeys(s for row in rows for s in row))


def attention_mask(
    prefix_lens: Sequence[int], extend_lens: Sequence[int], rows: Sequence[Sequence[int]], slots: Sequence[int]
) -> torch.Tensor:
    """[sum(extend_lens), len(slots)] bool: True where packed token t reads KV slot slots[c]. Token k
    of request i stands at position prefix_lens[i] + k and reads rows[i][0 .. that position]."""
    column = {s: c for c, s in enumerate(slots)}
    mask = torch.zeros(sum(extend_lens), len(slots), dtype=torch.bool)
    t = 0  # the packed token
    for prefix, n, row in zip(prefix_lens, extend_lens, rows):
        for k in range(n):
            mask[t, [column[s] for s in row[: prefix + k + 1]]] = True
            t += 1
    return mask


def masked_attention(layer: LayerCapture, mask: torch.Tensor) -> torch.Tensor:
    """Attention of the recorded layer computed densely, [num_tokens, num_heads * head_dim] in
    float32: every query against every captured KV slot, `mask` ([num_tokens, slots] bool) keeping
    the pairs to attend. Query head h reads KV head h // (num_heads / num_kv_heads) (GQA)."""
    q, k, v = layer.q.float(), layer.k.float(), layer.v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * layer.scaling
    scores = scores.masked_fill(~mask.to(torch.bool)[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def attention_errors(step: PackedStep, mask: torch.Tensor) -> torch.Tensor:
    """[num_tokens]: for each packed token, the largest difference between the backend's output for
    the recorded layer and attention computed densely with `mask` over `step.kv_slots` (nan for a
    token that reads nothing)."""
    if step.layer is None:
        raise ValueError("this forward has no layer capture (its layers ran inside a CUDA graph)")
    return (masked_attention(step.layer, mask) - step.layer.out.float()).abs().amax(dim=1)


def mask_error(step: PackedStep, mask: torch.Tensor) -> float:
    """The largest of `attention_errors`: 0 up to float rounding when `mask` is the attention the
    backend computed."""
    return float(attention_errors(step, mask).max())


def _tolerance(step: PackedStep) -> float:
    assert step.layer is not None
    return 1e-4 if step.layer.q.dtype == torch.float32 else 3e-2


def check_positions(positions_fn: Callable[[list[int], list[int]], Sequence[int]], *steps: PackedStep) -> None:
    """Assert that `positions_fn(prefix_lens, extend_lens)` gives each recorded forward's positions."""
    for step in steps:
        mine = [int(p) for p in positions_fn(list(step.prefix_lens), list(step.extend_lens))]
        assert mine == step.positions, (
            f"{step.forward_mode} step (prefix_lens {step.prefix_lens}, extend_lens {step.extend_lens}): "
            f"got {mine}, the ForwardBatch has {step.positions}"
        )
    print(f"positions: right for all {len(steps)} steps")


def check_attention_mask(mask_fn: Callable[..., Any], *steps: PackedStep) -> None:
    """Assert that `mask_fn(prefix_lens, extend_lens, rows, slots)` ([num_tokens, len(slots)] bool)
    is the attention the backend computed in each recorded forward: attention computed densely with
    it over the step's KV slots must equal the backend's output for the recorded layer. The slots are
    given in two orders, as the rows list them and sorted by slot number."""
    for step in steps:
        for slots in (step.kv_slots, sorted(step.kv_slots)):
            rows = [list(r) for r in step.req_to_token]
            mine = torch.as_tensor(mask_fn(list(step.prefix_lens), list(step.extend_lens), rows, list(slots)))
            shape = (step.num_tokens, len(slots))
            assert tuple(mine.shape) == shape, (
                f"{step.forward_mode} step: mask of shape {tuple(mine.shape)}, not {shape}"
            )
            # The backend's layer read the KV in kv_slots order: put the columns in that order.
            position_of = {s: c for c, s in enumerate(slots)}
            ordered = mine.to(torch.bool)[:, [position_of[s] for s in step.kv_slots]]
            error = mask_error(step, ordered)
            if not error <= _tolerance(step):
                wrong = (ordered != step.mask()).nonzero().tolist()
                hint = ""
                if wrong:
                    t, c = wrong[0]
                    reads = "reads" if ordered[t, c] else "does not read"
                    hint = (
                        f"; e.g. packed token {t} ({step.rids[step.token_rows[t]]}, position {step.positions[t]}) "
                        f"{reads} slot {step.kv_slots[c]}"
                    )
                raise AssertionError(
                    f"{step.forward_mode} step: attention with this mask is off from the backend's by {error:.3g}"
                    f"{hint} ({len(wrong)} cells differ from the attention the backend computed)"
                )
    print(f"attention mask: the backend's attention in all {len(steps)} steps, in both slot orders")


def padding_cost(step: PackedStep) -> pd.DataFrame:
    """What the packed forward computes against a padded batch of the same requests: new tokens padded
    to the longest row's ([batch_size, max extend_len] inputs), KV padded to the longest sequence,
    and the query x KV pairs of that [batch_size, max extend_len, max seq_len] score tensor against
    the pairs the packed forward's mask keeps."""
    bs, longest, max_seq = step.batch_size, max(step.extend_lens), max(step.seq_lens)
    packed = [step.num_tokens, sum(step.seq_lens), int(step.mask(unique_slots(step.req_to_token)).sum())]
    padded = [bs * longest, bs * max_seq, bs * longest * max_seq]
    frame = pd.DataFrame(
        {"packed": packed, "padded": padded},
        index=["input tokens", "KV entries per layer", "query x KV pairs"],
    )
    frame["padding"] = frame.padded - frame.packed
    frame["padding %"] = (100 * frame.padding / frame.padded).round(1)
    return frame


class record_forwards:
    """`with record_forwards(engine) as forwards:` appends a PackedStep to the list `forwards` for
    every forward of the engine's ModelRunner inside the block, with layer `layer`'s attention
    captured (see the module docstring). Wraps three methods of those instances only, for the block.
    It copies every forward's tensors to the host, so a recorded step waits for its forward (on a GPU
    it gives up overlap scheduling, as tracing does)."""

    def __init__(self, engine: Any, layer: int = 0) -> None:
        self.runner = engine.model_runner
        self.layer_id = layer
        self.steps: list[PackedStep] = []
        self._originals: list[tuple[Any, str, Any]] = []
        self._rows: tuple[list[str], list[list[int]]] | None = None  # (rids, tokens) of the batch being built
        self._capture: LayerCapture | None = None

    def __enter__(self) -> list[PackedStep]:
        runner = self.runner
        for obj, name, wrapper in (
            (runner, "build_forward_batch", self._build_forward_batch),
            (runner, "forward", self._forward),
            (runner.attn_backend, "forward", self._attend),
        ):
            self._originals.append((obj, name, getattr(obj, name)))
            obj.__dict__[name] = wrapper  # an instance attribute shadows the class's method
        return self.steps

    def __exit__(self, *exc: object) -> None:
        for obj, name, _ in reversed(self._originals):
            del obj.__dict__[name]
        self._originals = []

    def _original(self, obj: Any, name: str) -> Any:
        return next(f for o, n, f in self._originals if o is obj and n == name)

    def _build_forward_batch(self, batch: Any) -> ForwardBatch:
        fb = self._original(self.runner, "build_forward_batch")(batch)
        # Each request's tokens: what its KV held before the step, then its new tokens of this batch.
        inputs, start, seqs = fb.input_ids.tolist(), 0, []
        for req, prefix, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            seqs.append(req.all_ids[:prefix] + inputs[start : start + n])
            start += n
        if fb.forward_mode == ForwardMode.TARGET_VERIFY:  # a row per input token: row j reads up to it
            rids = [r.rid for r, n in zip(batch.reqs, batch.extend_lens) for _ in range(n)]
            seqs = [s for s, n in zip(seqs, batch.extend_lens) for _ in range(n)]
        else:
            rids = [r.rid for r in batch.reqs]
        self._rows = (rids, seqs)
        return fb

    def _rows_of(self, fb: ForwardBatch) -> list[list[int]]:
        table = fb.req_to_token_pool.host
        return [table[i, :n].tolist() for i, n in zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu)]

    def _forward(self, fb: ForwardBatch) -> torch.Tensor:
        self._capture = None
        logits = self._original(self.runner, "forward")(fb)
        decode = fb.forward_mode.is_decode()
        prefix_lens = [n - 1 for n in fb.seq_lens_cpu] if decode else list(fb.extend_prefix_lens_cpu)
        extend_lens = [1] * fb.batch_size if decode else list(fb.extend_seq_lens_cpu)
        rids, seqs = self._rows or ([""] * fb.batch_size, [[] for _ in range(fb.batch_size)])
        self._rows = None
        self.steps.append(
            PackedStep(
                forward_mode=fb.forward_mode.name,
                rids=rids,
                input_ids=fb.input_ids.tolist(),
                positions=fb.positions.tolist(),
                out_cache_loc=fb.out_cache_loc.tolist(),
                req_pool_indices=fb.req_pool_indices.tolist(),
                seq_lens=list(fb.seq_lens_cpu),
                prefix_lens=prefix_lens,
                extend_lens=extend_lens,
                req_to_token=self._rows_of(fb),
                tokens=[s[:n] for s, n in zip(seqs, fb.seq_lens_cpu)],
                logits=logits.detach().float().cpu().clone(),
                layer=self._capture,
            )
        )
        return logits

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Any,
        fb: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        out = self._original(self.runner.attn_backend, "forward")(q, k, v, layer, fb, save_kv_cache)
        if layer.layer_id == self.layer_id:
            pool = fb.token_to_kv_pool
            slots = torch.tensor(unique_slots(self._rows_of(fb)), dtype=torch.int64, device=out.device)
            self._capture = LayerCapture(
                layer.layer_id,
                q.detach().cpu().clone(),
                out.detach().cpu().clone(),
                pool.get_key_buffer(layer.layer_id)[slots].cpu().clone(),
                pool.get_value_buffer(layer.layer_id)[slots].cpu().clone(),
                layer.scaling,
            )
        return out


# ---- figures --------------------------------------------------------------------------------------
# A request's colour comes from its row of req_to_token (req_pool_idx), which it keeps for its whole
# life: the same request has the same colour in every step's figures.


def _color(step: PackedStep, i: int) -> str:
    return style.request_color(step.req_pool_indices[i])


def _bounds(lens: Sequence[int]) -> list[int]:
    return [int(x) for x in np.cumsum([0, *lens])]


def draw_packed_batch(step: PackedStep, tokenizer: Any = None, *, title: str | None = None) -> Figure:
    """Top: the forward's input as the model sees it, one row of `num_tokens` cells (Rectangle gid
    "token:<t>"), coloured by request, with each token's position and out_cache_loc below. Bottom: a
    padded batch of the same requests, one row per request padded to the longest (gid "pad:<i>:<k>"
    for a pad cell)."""
    T, bs, longest = step.num_tokens, step.batch_size, max(step.extend_lens)
    cell = min(0.62, 10.5 / max(T, 1))
    fig = style.new_figure(2.0 + T * cell, 1.9 + 0.42 * bs)
    ax = fig.subplots()
    fs = 7 if cell > 0.45 else 5.5
    rows = step.token_rows
    show_text = cell >= 0.3
    rotation = 90 if cell < 0.45 else 0

    def label(t: int, x: float, y: float) -> None:
        if show_text:
            text = token_text(tokenizer, [step.input_ids[t]], limit=7)
            ax.text(x, y, text, ha="center", va="center", fontsize=fs, color="white", rotation=rotation)

    for t in range(T):
        ax.add_patch(
            Rectangle((t, 0), 1, 1, facecolor=_color(step, rows[t]), edgecolor="white", lw=1, gid=f"token:{t}")
        )
        label(t, t + 0.5, 0.5)
        ax.text(t + 0.5, -0.35, str(step.positions[t]), ha="center", va="center", fontsize=fs)
        ax.text(t + 0.5, -0.8, str(step.out_cache_loc[t]), ha="center", va="center", fontsize=fs)
    for name, y in (("input_ids", 0.5), ("positions", -0.35), ("out_cache_loc", -0.8)):
        ax.text(-0.2, y, name, ha="right", va="center", fontsize=8)
    bounds = _bounds(step.extend_lens)
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        ax.plot([a + 0.08, b - 0.08], [1.15, 1.15], color=_color(step, i), lw=2)
        ax.text((a + b) / 2, 1.25, step.rids[i], ha="center", va="bottom", fontsize=7.5, color=_color(step, i))
    ax.text(0, 1.75, f"packed: {T} tokens in one row, no padding", fontsize=9, weight="bold", va="bottom")
    top = -1.8  # the padded batch below
    pads = bs * longest - T
    ax.text(0, top + 0.25, f"padded: {bs} rows x {longest} = {bs * longest} tokens, {pads} of them padding",
            fontsize=9, weight="bold", va="bottom")  # fmt: skip
    for i in range(bs):
        y = top - (i + 1) * 0.8
        for k in range(longest):
            real = k < step.extend_lens[i]
            ax.add_patch(
                Rectangle(
                    (k, y), 1, 0.7, facecolor=_color(step, i) if real else PAD, edgecolor="white", lw=1,
                    hatch=None if real else "///", gid=None if real else f"pad:{i}:{k}",
                )
            )  # fmt: skip
            if real:
                label(bounds[i] + k, k + 0.5, y + 0.35)
        ax.text(-0.2, y + 0.35, step.rids[i], ha="right", va="center", fontsize=8, color=_color(step, i))
    ax.set_xlim(-3.2, T + 0.1)
    ax.set_ylim(top - bs * 0.8 - 0.2, 2.3)
    ax.axis("off")
    ax.set_title(title or f"A {step.forward_mode} forward's input", loc="left", fontsize=10, weight="bold")
    return fig


def draw_req_to_token(step: PackedStep, *, title: str | None = None) -> Figure:
    """Each batch row's row of req_to_token as the forward read it: one cell per position, the KV slot
    number inside; the cached prefix light (gid "prefix:<i>:<pos>"), the slots this forward writes
    (out_cache_loc) in full colour (gid "new:<i>:<pos>")."""
    longest = max(step.seq_lens)
    cell = min(0.34, 11.0 / longest)
    fig = style.new_figure(1.8 + longest * cell, 0.9 + 0.36 * step.batch_size)
    ax = fig.subplots()
    fs = 6 if cell >= 0.26 else 5
    for i, row in enumerate(step.req_to_token):
        color = _color(step, i)
        for pos, slot in enumerate(row):
            new = pos >= step.prefix_lens[i]
            face = color if new else to_rgba(color, PREFIX_ALPHA)
            kind = "new" if new else "prefix"
            ax.add_patch(
                Rectangle((pos, i), 1, 0.9, facecolor=face, edgecolor="white", lw=0.6, gid=f"{kind}:{i}:{pos}")
            )
            ax.text(pos + 0.5, i + 0.45, str(slot), ha="center", va="center", fontsize=fs,
                    color="white" if new else "black", rotation=90 if cell < 0.2 else 0)  # fmt: skip
    ax.set_yticks([i + 0.45 for i in range(step.batch_size)])
    ax.set_yticklabels([f"{rid}: row {p}" for rid, p in zip(step.rids, step.req_pool_indices)], fontsize=8)
    for i, tick in enumerate(ax.get_yticklabels()):
        tick.set_color(_color(step, i))
    ax.set_xlim(0, longest)
    ax.set_ylim(step.batch_size, -0.1)
    ticks = range(0, longest, 5)
    ax.set_xticks([p + 0.5 for p in ticks], [str(p) for p in ticks], fontsize=7)
    ax.set_xlabel("position in the request", fontsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    grey = "#777777"
    handles = [
        Patch(facecolor=to_rgba(grey, PREFIX_ALPHA), label="prefix: KV already in the pool"),
        Patch(facecolor=grey, label="new: written by this forward (out_cache_loc)"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, -0.18 - 0.3 / step.batch_size), ncol=2,
              fontsize=7.5, frameon=False)  # fmt: skip
    ax.set_title(title or f"req_to_token rows of a {step.forward_mode} forward: the KV slot of every position",
                 loc="left", fontsize=10, weight="bold")  # fmt: skip
    return fig


COLUMNS = ("rows", "slots", "sorted")


def draw_attention_mask(
    step: PackedStep, tokenizer: Any = None, *, columns: str = "rows", title: str | None = None
) -> Figure:
    """The attention of one forward as a mask: a row per packed query token, a column per KV slot
    read. `columns`: "rows" lays the requests' req_to_token rows side by side (a slot in two rows
    appears in both), "slots" lists every slot once in that order, "sorted" once by slot number; a
    slot in two requests' rows has its number in amber. A cell is coloured when the query reads that column: its
    request's colour, light for a slot of the cached prefix, full for a slot this forward writes;
    the query's own slot (its out_cache_loc) is outlined (gid "own:<t>"). `fig.labkit_mask` is the
    bool mask drawn, [num_tokens, columns]."""
    if columns not in COLUMNS:
        raise ValueError(f"columns must be one of {COLUMNS}, got {columns!r}")
    rows = step.token_rows
    if columns == "rows":  # column j: (slot, request, position)
        cols = [(s, i, pos) for i, row in enumerate(step.req_to_token) for pos, s in enumerate(row)]
        mask = torch.tensor(
            [[i == rows[t] and pos <= step.positions[t] for _, i, pos in cols] for t in range(step.num_tokens)]
        )
        own = [next(j for j, (_, i, pos) in enumerate(cols) if i == rows[t] and pos == step.positions[t])
               for t in range(step.num_tokens)]  # fmt: skip
        slots = [s for s, _, _ in cols]
    else:
        slots = sorted(step.kv_slots) if columns == "sorted" else step.kv_slots
        mask = step.mask(slots)
        own = [slots.index(s) for s in step.out_cache_loc]
    T, S = mask.shape
    new_slots = set(step.out_cache_loc)
    image = np.ones((T, S, 4))
    for t in range(T):
        color = _color(step, rows[t])
        for c in mask[t].nonzero().flatten().tolist():
            image[t, c] = to_rgba(color, 1.0 if slots[c] in new_slots else PREFIX_ALPHA)
    cw = min(0.16, 10.5 / S)
    rh = min(0.2, max(0.12, 6.0 / T))
    fig = style.new_figure(2.6 + S * cw, 1.9 + T * rh)
    ax = fig.subplots()
    ax.imshow(image, aspect="auto", interpolation="nearest")
    for t, c in enumerate(own):
        ax.add_patch(Rectangle((c - 0.5, t - 0.5), 1, 1, fill=False, edgecolor=OWN_EDGE, lw=0.9, gid=f"own:{t}"))
    for b in _bounds(step.extend_lens)[1:-1]:
        ax.axhline(b - 0.5, color="#555555", lw=0.8)
    if columns == "rows":
        for b in _bounds(step.seq_lens)[1:-1]:
            ax.axvline(b - 0.5, color="#555555", lw=0.8)
    ax.set_xticks(np.arange(-0.5, S, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, T, 1), minor=True)
    ax.grid(which="minor", color="#e6e6e6", lw=0.4)
    ax.tick_params(which="minor", length=0)
    every = max(1, int(np.ceil(S / 110)))
    ax.set_xticks(range(0, S, every), [str(slots[c]) for c in range(0, S, every)], fontsize=5, rotation=90)
    readers = [s for row in step.req_to_token for s in set(row)]
    shared = {s for s in set(readers) if readers.count(s) > 1}
    for tick, c in zip(ax.get_xticklabels(), range(0, S, every)):
        if slots[c] in shared:
            tick.set_color(SHARED_TEXT)
            tick.set_fontweight("bold")
    labels = [
        f"{step.rids[rows[t]]} {step.positions[t]:>3} {token_text(tokenizer, [step.input_ids[t]], limit=10)!r}"
        for t in range(T)
    ]
    ax.set_yticks(range(T), labels, fontsize=6.5 if rh >= 0.15 else 5.5)
    for t, tick in enumerate(ax.get_yticklabels()):
        tick.set_color(_color(step, rows[t]))
    order = {
        "rows": "the requests' req_to_token rows side by side",
        "slots": "each once, in the order of the req_to_token rows",
        "sorted": "each once, sorted by slot number",
    }[columns]
    ax.set_xlabel(f"KV slot read ({S} columns: {order})", fontsize=8)
    ax.set_ylabel("query token: request, position, text", fontsize=8)
    grey = "#777777"
    handles = [
        Patch(facecolor=to_rgba(grey, PREFIX_ALPHA), label="reads a slot of the cached prefix"),
        Patch(facecolor=grey, label="reads a slot this forward writes"),
        Patch(facecolor=NOT_READ, edgecolor="#999999", label="does not read"),
        Patch(facecolor="none", edgecolor=OWN_EDGE, label="the query's own slot (out_cache_loc)"),
    ]
    if shared:
        handles.append(Patch(facecolor=SHARED_TEXT, label="slot number in amber: read by two requests"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=5, fontsize=7, frameon=False)
    ax.set_title(
        title or f"{step.forward_mode} forward: {T} query tokens x {S} KV columns, {int(mask.sum())} pairs attended",
        loc="left", fontsize=10, weight="bold", pad=18,
    )  # fmt: skip
    fig.labkit_mask = mask  # type: ignore[attr-defined]  # a plain attribute for tests, as kvpool does
    return fig
