"""Short summaries of the engine's live objects, so that evaluating one in a notebook cell shows what
it holds instead of `<... object at 0x...>`: a class derives from `Summarized` and says what matters
in `summary()`; its repr is one line, its `_repr_html_` (what Jupyter shows) a small table."""

from __future__ import annotations

from html import escape
from typing import Any


class Summarized:
    """repr and _repr_html_ from `summary()` (and `html_details()` for more under the table)."""

    def summary(self) -> dict[str, Any]:
        raise NotImplementedError

    def html_details(self) -> str:
        """Extra HTML under the table (a tree, a list); empty by default."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in self.summary().items())})"

    def _repr_html_(self) -> str:
        cell = "padding:1px 8px;text-align:left"
        rows = "".join(
            f"<tr><th style='{cell}'>{escape(str(k))}</th><td style='{cell}'>{escape(str(v))}</td></tr>"
            for k, v in self.summary().items()
        )
        return f"<div><b>{type(self).__name__}</b><table>{rows}</table>{self.html_details()}</div>"
