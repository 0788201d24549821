"""The server's options come from the engine's: each EngineConfig field's help metadata, and the
policy and attention-backend registries for their choices."""

from __future__ import annotations

import dataclasses

import pytest

from labkit.config import EngineConfig
from labkit.scheduler.schedule_policy import POLICIES, SchedulePolicy, register_policy
from labkit.server.server_args import HIDDEN_ENGINE_FIELDS, ServerArgs, build_parser


def actions() -> dict:
    return {a.dest: a for a in build_parser()._actions}


def test_every_engine_option_takes_its_help_from_the_config_field():
    by_dest = actions()
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata["help"], f.name  # every field is documented, the hidden ones too
        if f.name not in HIDDEN_ENGINE_FIELDS:
            assert by_dest[f.name].help == f.metadata["help"]


def test_policy_and_backend_choices_come_from_the_registries():
    by_dest = actions()
    assert by_dest["schedule_policy"].choices == sorted(POLICIES)
    assert {"auto", "torch_native", "triton", "flashinfer"} <= set(by_dest["attention_backend"].choices)

    @register_policy("shortest-prompt")
    class ShortestPrompt(SchedulePolicy):
        def sort(self, waiting, tree_cache):
            waiting.sort(key=lambda r: len(r.origin_input_ids))

    try:
        assert ServerArgs.from_cli(["--schedule-policy", "shortest-prompt"]).engine.schedule_policy == "shortest-prompt"
    finally:
        del POLICIES["shortest-prompt"]
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--schedule-policy", "shortest-prompt"])
