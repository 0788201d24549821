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
    attention_errors(step, step.mask())   # attention with a mask, per token, against the backend's output
    padding_cost(step)                    # what a padded batch of the same requests would compute
    check_positions(fn, step); check_attention_mask(fn, step)   # a learner's fn against the real forward

The attention contract (labkit/attention/base.py): token t of request i, at position p, reads the KV
of request i at positions 0..p (its cached prefix through req_to_token, and the new tokens up to
itself), nothing of other requests. Over the KV slots a batch reads, that is a mask with one block
per request, causal within it. Its figures are in labkit.viz.packed_figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from labkit.model_executor.forward_batch import ForwardBatch, ForwardMode
from labkit.viz.run import token_text


@dataclass
class LayerCapture:
    """One layer's attention in a recorded forward: the backend's inputs and output, and the K and V
    of every KV slot the batch reads (`PackedStep.kv_slots`, in that order) as the pool held them
    right after the layer wrote the new tokens' KV (in q's dtype: a float8 pool's dequantized)."""

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
            slots = torch.tensor(unique_slots(self._rows_of(fb)), dtype=torch.int64, device=out.device)
            k_read, v_read = fb.token_to_kv_pool.get_kv(layer.layer_id, slots, q.dtype)
            self._capture = LayerCapture(
                layer.layer_id,
                q.detach().cpu().clone(),
                out.detach().cpu().clone(),
                k_read.cpu().clone(),
                v_read.cpu().clone(),
                layer.scaling,
            )
        return out


# ---- figures --------------------------------------------------------------------------------------
# A request's colour comes from its row of req_to_token (req_pool_idx), which it keeps for its whole
# life: the same request has the same colour in every step's figures.
