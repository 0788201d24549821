"""Trace hooks: record the ten stations, scheduler steps and radix-tree changes; export to pandas/Perfetto."""

from labkit.trace.events import PoolUsage, Station, StationEvent, StepRecord, TierUsage, TreeEvent
from labkit.trace.export import from_perfetto, save_perfetto, to_dataframe, to_perfetto
from labkit.trace.recorder import Tracer, shorten
from labkit.trace.snapshot import NodeState, StepSnapshot, TreeSnapshot, WaitingState

__all__ = [
    "PoolUsage", "Station", "StationEvent", "StepRecord", "TierUsage", "TreeEvent", "Tracer",
    "from_perfetto", "save_perfetto", "shorten", "to_dataframe", "to_perfetto",
    "NodeState", "StepSnapshot", "TreeSnapshot", "WaitingState",
]  # fmt: skip
