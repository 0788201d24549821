"""Role blocks for `system(...)`, `user(...)` and `assistant(...)`: the text the model's chat
template puts before and after each message's content. SGLang keeps a hand-written table per model
family; labkit reads them off the model's own (Jinja) template instead, by rendering messages
holding marker strings and cutting the output at the markers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.lang.ir import ROLES

_MARKS = {role: f"@@labkit-{role}-content@@" for role in ROLES}


@dataclass(frozen=True)
class ChatTemplate:
    """`role_prefix_and_suffix[role]` wraps a message's content; `default_system_prompt` is the
    system message the template adds when a conversation opens with another role (SGLang inserts it
    the same way); `first_prefix` is text the template writes before the first message only (a BOS
    token in some templates)."""

    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    first_prefix: str = ""

    def prefix_and_suffix(self, role: str, first: bool) -> tuple[str, str]:
        """The text before and after a `role` message's content; `first`: it opens the conversation."""
        prefix, suffix = self.role_prefix_and_suffix[role]
        return (self.first_prefix + prefix if first else prefix), suffix

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate:
        """Read the role blocks off a Hugging Face tokenizer's chat template. Raises ValueError when
        it has none, or when its output does not grow message by message (then roles cannot be
        appended one at a time)."""
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("roles need the model's chat template, and this model's tokenizer has none")

        def render(roles: list[str]) -> str:
            messages = [{"role": r, "content": _MARKS[r]} for r in roles]
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

        blocks: dict[str, tuple[str, str]] = {}
        done = ""
        for n, role in enumerate(ROLES, 1):  # system, then system+user, then system+user+assistant
            text = render(list(ROLES[:n]))
            if not text.startswith(done) or text.count(_MARKS[role]) != 1:
                raise ValueError("the model's chat template does not render messages one after another")
            prefix, suffix = text[len(done) :].split(_MARKS[role])
            blocks[role] = (prefix, suffix)
            done = text
        user_prefix, user_suffix = blocks["user"]
        only_user, user_block = render(["user"]), user_prefix + _MARKS["user"] + user_suffix
        if not only_user.endswith(user_block):
            raise ValueError("the model's chat template renders a user message differently after a system one")
        head = only_user[: len(only_user) - len(user_block)]
        system_prefix, system_suffix = blocks["system"]
        if head.startswith(system_prefix) and head.endswith(system_suffix) and head:
            return cls(blocks, head[len(system_prefix) : len(head) - len(system_suffix)])
        # What a conversation opening with a user message has before it is then the first message's
        # own lead (e.g. BOS), which the system block read above carries too.
        blocks["system"] = (system_prefix.removeprefix(head), system_suffix)
        return cls(blocks, None, head)
