"""DetokenizerManager (station 9): a scheduler step's token ids -> text pieces, one
IncrementalDetokenizer per live request (made from the DetokenizeParams sent with its first output,
dropped when it finishes). The in-process Engine calls it after every step; the server's detokenizer
process calls it on every message from the scheduler process."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from labkit.io_struct import BatchStrOutput, BatchTokenIDOutput
from labkit.tokenizer.detokenizer import IncrementalDetokenizer
from labkit.trace.events import Station

if TYPE_CHECKING:
    from labkit.trace.recorder import Tracer


class DetokenizerManager:
    """Turns BatchTokenIDOutput into BatchStrOutput. Each output's `text` becomes the piece that is
    safe to emit now; the pieces of one request concatenate to its whole text (see
    IncrementalDetokenizer). Without a tokenizer (dummy weights) every piece is "".

    The finish check is not made here: the scheduler decides when a request ends (stop strings
    included) and says so in `finish_reason`; this only holds back what might start a stop string
    and flushes the rest when the request finishes."""

    def __init__(self, tokenizer: Any, tracer: Tracer | None = None):
        self.tokenizer = tokenizer
        self.tracer = tracer
        # By (tokenizer worker, rid): each worker keeps its own rids unique, not all of them together.
        self.decode_status: dict[tuple[int, str], IncrementalDetokenizer] = {}

    def handle(self, batch: BatchTokenIDOutput) -> BatchStrOutput:
        for out in batch.outputs:
            start = time.perf_counter()
            key = (out.worker, out.rid)
            detok = self.decode_status.get(key)
            if detok is None and out.detokenize is not None and self.tokenizer is not None:
                p = out.detokenize
                detok = self.decode_status[key] = IncrementalDetokenizer(
                    self.tokenizer,
                    stop=p.stop,
                    skip_special_tokens=p.skip_special_tokens,
                    spaces_between_special_tokens=p.spaces_between_special_tokens,
                )
            piece = detok.feed(out.token_ids) if detok is not None and out.token_ids else ""
            if out.finish_reason is not None:
                if detok is not None:
                    piece += detok.finish()
                self.decode_status.pop(key, None)
            out.text, out.detokenize = piece, None
            if self.tracer is not None:
                self.tracer.station(
                    out.rid,
                    Station.DETOKENIZE,
                    start,
                    time.perf_counter(),
                    step=batch.step,
                    token=out.token_ids[-1] if out.token_ids else None,  # at most one per step
                    piece=piece,
                    finish_reason=out.finish_reason,
                )
        return BatchStrOutput(outputs=batch.outputs, trace=batch.trace)
