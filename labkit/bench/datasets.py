"""Workloads: seeded random prompts, shared-prefix groups, chat and multi-turn conversations.

Each kind of prompt is generated once, then shaped for one of two consumers:

- `BenchRequest` lists for the serving benchmark (labkit.bench.serving): `random_requests`,
  `shared_prefix_requests`, `multiturn_requests`, `multiturn_random_requests`;
- `Request` lists for playing through an Engine step by step (labkit.bench.runner, the notebooks):
  `random_workload`, `shared_prefix_workload`, `chat_requests`, each with an rid, sampling
  parameters and an arrival step.

Random, shared-prefix and random multi-turn prompts are token ids with exact lengths (EOS ignored, so
the output length is the workload's, not the model's choice); chat and multi-turn prompts are messages."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labkit.tokenizer.prompt import encode_prompt

MULTITURN_FILE = Path(__file__).resolve().parents[2] / "data" / "multiturn_chat.json"
FIRST_ID = 100  # the lowest ids hold special tokens (SmolLM2: 0..16); keep random prompts clear of them

Message = dict[str, str]


@dataclass
class BenchRequest:
    """One request of the serving benchmark."""

    prompt: list[int] | list[Message]  # token ids, or chat messages
    prompt_len: int  # tokens (for messages: after the chat template)
    output_len: int  # max_tokens
    ignore_eos: bool = True
    conversation: int | None = None  # a chat's turns: each is sent only once its previous turn finished
    turn: int = 0  # 0-based, within its conversation

    @property
    def is_chat(self) -> bool:
        return bool(self.prompt) and isinstance(self.prompt[0], dict)


def previous_turns(requests: list[BenchRequest]) -> list[int | None]:
    """Per request, the index of the one it must wait for: the latest earlier request of the same
    conversation's previous turn (None: none, or not part of a conversation). A real chat client sends
    its next message only after the reply to the last one arrived; both benchmark backends do the same."""
    latest: dict[tuple[int, int], int] = {}  # (conversation, turn) -> latest index
    out: list[int | None] = []
    for i, r in enumerate(requests):
        if r.conversation is None:
            out.append(None)
            continue
        out.append(latest.get((r.conversation, r.turn - 1)))
        latest[r.conversation, r.turn] = i
    return out


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """`n` uniform ids in [FIRST_ID, vocab_size)."""
    if vocab_size <= FIRST_ID:
        raise ValueError(f"vocab size {vocab_size} leaves no ids above the special-token range")
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(n)]


def _random_prompts(
    rng: random.Random, num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int
) -> list[tuple[list[int], int]]:
    """`num` (prompt ids, output length) pairs, both lengths uniform in their inclusive ranges."""
    out = []
    for _ in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        out.append((random_ids(rng, n_in, vocab_size), n_out))
    return out


def _shared_prefix_prompts(
    rng: random.Random, num_groups: int, per_group: int, prefix_len: int, question_len: int, vocab_size: int
) -> list[list[list[int]]]:
    """Per group, `per_group` prompts: the group's random prefix plus a random question each."""
    groups = []
    for _ in range(num_groups):
        prefix = random_ids(rng, prefix_len, vocab_size)
        groups.append([prefix + random_ids(rng, question_len, vocab_size) for _ in range(per_group)])
    return groups


# ---- for the serving benchmark ------------------------------------------------------------------
def random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """Lengths uniform in [range_ratio * full, full] (at least 1), as SGLang's random dataset."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    rng = random.Random(seed)
    in_range, out_range = ((max(1, int(full * range_ratio)), max(1, full)) for full in (input_len, output_len))
    prompts = _random_prompts(rng, num_prompts, in_range, out_range, vocab_size)
    return [BenchRequest(ids, len(ids), n_out) for ids, n_out in prompts]


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
    groups = _shared_prefix_prompts(rng, num_groups, prompts_per_group, system_prompt_len, question_len, vocab_size)
    out = [BenchRequest(ids, len(ids), output_len) for group in groups for ids in group]
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


def multiturn_random_requests(
    num_conversations: int,
    turns: int,
    system_len: int,
    user_len: int,
    assistant_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """C conversations of T turns in random token ids. Turn k's prompt is the conversation's system
    prompt, then its user messages 1..k, each message before k followed by that turn's assistant
    reply as the dataset records it (fixed random ids, not the model's output, as the chat file's
    replies), so turn k+1's prompt starts with turn k's. Ordered round by round (every conversation's
    first turn, then every second turn, ...): with enough conversations, the ones between two turns
    of a conversation push its history out of a small KV pool."""
    lengths = {"num_conversations": num_conversations, "turns": turns, "user_len": user_len, "output_len": output_len}
    for name, value in lengths.items():
        if value < 1:
            raise ValueError(f"multi-turn {name} must be >= 1, got {value}")
    if system_len < 0 or assistant_len < 0:
        raise ValueError(f"multi-turn system and assistant lengths must be >= 0, got {system_len}, {assistant_len}")
    rng = random.Random(seed)
    rounds: list[list[BenchRequest]] = [[] for _ in range(turns)]
    for c in range(num_conversations):
        ids = random_ids(rng, system_len, vocab_size)
        for k in range(turns):
            if k:
                ids = ids + random_ids(rng, assistant_len, vocab_size)  # the reply to turn k - 1
            ids = ids + random_ids(rng, user_len, vocab_size)
            rounds[k].append(BenchRequest(ids, len(ids), output_len, conversation=c, turn=k))
    return [r for this_round in rounds for r in this_round]


def chat_prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of the chat template applied to `messages`, as labkit's Engine tokenizes them."""
    return encode_prompt(tokenizer, messages=messages)[1]


# ---- for step-by-step runs ------------------------------------------------------------------------
@dataclass
class Request:
    """One request of a workload played through an Engine. Exactly one of input_ids / messages / prompt."""

    rid: str
    input_ids: list[int] | None = None
    messages: list[Message] | None = None
    prompt: str | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    arrive_step: int = 0  # engine steps run before it arrives (0: before the first)
    group: str | None = None  # e.g. which shared prefix it uses


def _length_params(output_len: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}


def random_workload(
    num: int = 24,
    input_len: tuple[int, int] = (32, 384),
    output_len: tuple[int, int] = (8, 24),
    vocab_size: int = 2048,
    seed: int = 0,
) -> list[Request]:
    """Independent requests with random tokens (nothing to share) and random lengths."""
    prompts = _random_prompts(random.Random(seed), num, input_len, output_len, vocab_size)
    return [Request(f"r{i}", input_ids=ids, sampling_params=_length_params(n)) for i, (ids, n) in enumerate(prompts)]


def shared_prefix_workload(
    num_groups: int = 6,
    per_group: int = 4,
    prefix_len: int = 256,
    question_len: int = 16,
    output_len: tuple[int, int] = (8, 24),
    vocab_size: int = 2048,
    interleave: bool = True,
    seed: int = 0,
) -> list[Request]:
    """Groups of requests that share a long prefix (a system prompt, few-shot examples, a document)
    and differ in a short question. `interleave` sends them round-robin over the groups (g0, g1, ...,
    g0, g1, ...), the arrival order in which first-come-first-served keeps losing its prefixes."""
    rng = random.Random(seed)
    groups = _shared_prefix_prompts(rng, num_groups, per_group, prefix_len, question_len, vocab_size)
    reqs = [
        Request(f"g{g}-q{q}", input_ids=ids, group=f"g{g}", sampling_params=_length_params(rng.randint(*output_len)))
        for g, group in enumerate(groups)
        for q, ids in enumerate(group)
    ]
    if interleave:
        reqs.sort(key=lambda r: (int(r.rid.split("-q")[1]), r.rid))
    return reqs


def chat_requests(
    system_prompts: list[str], questions: list[str], max_new_tokens: int = 16, prefix: str = "req"
) -> list[Request]:
    """One chat request per (system prompt, question), system prompts round-robin over questions."""
    out = []
    for i, q in enumerate(questions):
        system = system_prompts[i % len(system_prompts)]
        out.append(
            Request(
                f"{prefix}-{i}",
                messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens},
                group=f"system-{i % len(system_prompts)}",
            )
        )
    return out
