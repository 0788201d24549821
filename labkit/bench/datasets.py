"""Workloads for the serving benchmark: seeded random prompts, shared-prefix groups, multi-turn chat.

Every generator returns a list of `BenchRequest`. Random and shared-prefix prompts are token ids
(exact lengths, EOS ignored); multi-turn prompts are chat messages with a max_tokens cap."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.tokenizer.prompt import encode_prompt

MULTITURN_FILE = Path(__file__).resolve().parents[2] / "data" / "multiturn_chat.json"
FIRST_ID = 100  # the lowest ids hold special tokens (SmolLM2: 0..16); keep random prompts clear of them

Message = dict[str, str]


@dataclass
class BenchRequest:
    prompt: list[int] | list[Message]  # token ids, or chat messages
    prompt_len: int  # tokens (for messages: after the chat template)
    output_len: int  # max_tokens
    ignore_eos: bool = True

    @property
    def is_chat(self) -> bool:
        return bool(self.prompt) and isinstance(self.prompt[0], dict)


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """`n` uniform ids in [FIRST_ID, vocab_size)."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab size {vocab_size} leaves no ids above the special-token range")
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def _length(rng: random.Random, full: int, range_ratio: float) -> int:
    """Uniform in [range_ratio * full, full], at least 1."""
    return rng.randint(max(1, int(full * range_ratio)), max(1, full))


def random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in, n_out = _length(rng, input_len, range_ratio), _length(rng, output_len, range_ratio)
        out.append(BenchRequest(random_ids(rng, n_in, vocab_size), n_in, n_out))
    return out


def shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """G groups of P prompts: a random system prompt per group plus a random question each.
    The list is shuffled (seeded) so the groups interleave, as independent users would."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_groups):
        system = random_ids(rng, system_prompt_len, vocab_size)
        for _ in range(prompts_per_group):
            ids = system + random_ids(rng, question_len, vocab_size)
            out.append(BenchRequest(ids, len(ids), output_len))
    rng.shuffle(out)
    return out


def load_conversations(path: str | Path = MULTITURN_FILE) -> list[list[dict[str, str]]]:
    """The file's conversations, each a list of {"user": ..., "assistant": ...} turns."""
    data: list[dict[str, Any]] = json.loads(Path(path).read_text())
    return [conv["turns"] for conv in data]


def multiturn_requests(
    tokenizer: Any, max_tokens: int, num_prompts: int | None = None, path: str | Path = MULTITURN_FILE
) -> list[BenchRequest]:
    """One request per user turn; its messages carry the earlier turns with the file's assistant
    replies, so turn k+1 extends turn k's prompt. Ordered round by round (every conversation's first
    turn, then every second turn, ...) so a later turn arrives after the one whose prefix it shares."""
    if tokenizer is None:
        raise ValueError("the multiturn dataset needs a tokenizer with a chat template")
    rounds: list[list[list[Message]]] = []
    for turns in load_conversations(path):
        history: list[Message] = []
        for k, turn in enumerate(turns):
            if k == len(rounds):
                rounds.append([])
            rounds[k].append(history + [{"role": "user", "content": turn["user"]}])
            history = rounds[k][-1] + [{"role": "assistant", "content": turn["assistant"]}]
    chats = [m for r in rounds for m in r][:num_prompts]
    return [BenchRequest(m, len(chat_prompt_ids(tokenizer, m)), max_tokens, ignore_eos=False) for m in chats]


def chat_prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of the chat template applied to `messages`, as labkit's Engine tokenizes them."""
    return encode_prompt(tokenizer, messages=messages)[1]
