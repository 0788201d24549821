"""Trace record types. Components build them only when a tracer is attached (tracing off costs one
`is None` check); the Tracer stores them and exports to pandas and Perfetto."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class Station(IntEnum):
    """The ten stations every request passes (docs/architecture.md maps each to its code)."""

    HTTP_RECEIVE = 1
    PARSE_VALIDATE = 2
    TOKENIZE = 3
    ZMQ_SEND = 4
    ENQUEUE = 5  # waiting queue + radix prefix match
    BATCH = 6  # picked into a ScheduleBatch
    FORWARD = 7
    SAMPLE = 8  # + the finish check (Req.check_finished, in the scheduler)
    DETOKENIZE = 9  # incremental detokenization
    RESPOND = 10


@dataclass
class StationEvent:
    rid: str
    station: Station
    start: float  # time.perf_counter() seconds
    end: float
    step: int | None = None  # scheduler step id, for stations 6-9
    detail: dict[str, Any] = field(default_factory=dict)  # JSON-able: what entered and left


@dataclass
class PoolUsage:
    """KV slots by owner. free + evictable + protected + request_owned == total, always."""

    total: int
    free: int
    evictable: int  # in the radix tree, no running request uses them
    protected: int  # in the radix tree, locked by a running request
    request_owned: int  # held by running requests, not (yet) in the tree


@dataclass
class TierUsage:
    """Host KV pool slots by owner (HiRadixCache). free + host_only + backed_up == total, always."""

    total: int
    free: int
    host_only: int  # tree nodes evicted from the device, kept only here
    backed_up: int  # host copies of device-resident nodes (eviction from the device then costs no copy)


@dataclass
class StepRecord:
    step: int
    start: float
    end: float
    forward_mode: str  # EXTEND / DECODE / MIXED / TARGET_VERIFY / IDLE
    rids: list[str]
    extend_lens: list[int]  # new tokens per request this step (1 for decodes)
    prefix_lens: list[int]
    num_tokens: int
    cache_hit_tokens: int  # prefix tokens served from the cache for requests first scheduled now
    pool: PoolUsage
    running: int
    waiting: int
    chunked_rid: str | None = None
    finished: list[str] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    # Per waiting request left in the queue: the limit that held it back (PrefillAdder's verdict).
    blocked: dict[str, str] = field(default_factory=dict)
    rank: int = 0  # the tensor-parallel rank that ran it (every rank runs every step)
    comm_calls: int = 0  # its collectives (all-reduce, all-gather) this step
    comm_bytes: int = 0  # the tensors they returned (CommStats)
    comm_seconds: float = 0.0  # time in them, where they block (gloo on CPU; 0 on CUDA, see CommStats)
    sampled_digest: int = 0  # crc32 of the (rid, token) pairs it took: equal on every rank of a step
    # MoE models: tokens routed to each expert, [MoE layer][expert] (global expert ids; every rank
    # routes every token, so the counts are the same on every rank). None for dense models.
    expert_tokens: list[list[int]] | None = None
    # Speculative decoding (TARGET_VERIFY steps): each drafting request's drafts, how many of them it
    # kept, and the KV slots allocated for the rejected ones and given back at once.
    drafts: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    rollback_slots: int = 0
    # Where the step's time went, phase -> (start, end) perf_counter seconds, for the phases it ran:
    # schedule (pick the batch, allocate its KV), prepare (build the ForwardBatch), forward, sample,
    # process (take in a launched batch's tokens: finish checks, placeholders replaced). `process`
    # took the tokens of step `processed_step`: this step's without overlap, an earlier one's with it.
    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    processed_step: int | None = None
    host_pool: TierUsage | None = None  # the host tier as the step left it (--enable-hierarchical-cache)


@dataclass
class TreeEvent:
    # "insert" | "split" | "evict" (the node left the tree); with the hierarchical cache also
    # "write_host" (its KV copied to the host), "offload" (its device copy freed, the host one kept),
    # "load_back" (host -> device), "drop_host" (its host copy freed), "disk_read" (a new node from disk)
    kind: str
    time: float
    node_id: int
    parent_id: int | None
    num_tokens: int  # tokens in the node concerned (new node for insert/split, removed for evict)
    # The node's key; the recorder cuts a long one to its head plus one str marker of the full length.
    tokens: list[int | str] = field(default_factory=list)
