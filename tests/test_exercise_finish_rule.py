"""Notebook 01's Build-it: check_finish_rule passes the given answer and rejects wrong finish rules
(replayed against Req.check_finished on token sequences shaped like real generations)."""

from __future__ import annotations

import random

import pytest

from labkit.sampling.sampling_params import SamplingParams
from labkit.scheduler.schedule_batch import Req
from tests.notebook_cells import run_cells

EOS = {2}
# Generations as the server records them: ended by EOS, cut by max_tokens, or by a stop string.
GENERATIONS = [
    [504, 3575, 282, 4649, 314, 7042, 30, 2],
    [504, 3575, 282, 3085, 314, 19081, 30, 2],
    [504, 3575, 282, 4649, 314],
    [11, 2, 13, 13, 2],  # EOS in the middle: generated with ignore_eos
]


@pytest.fixture(scope="module")
def notebook():
    names = {"random": random, "Req": Req, "SamplingParams": SamplingParams}
    return run_cells("01_request_journey", "build-finish-answer", "build-finish-check", **names)


def test_the_notebooks_answer_passes(notebook):
    notebook["check_finish_rule"](notebook["finish_rule"], GENERATIONS, EOS)


def _ignores_min_new_tokens(output_ids, params, eos_token_ids):
    last = output_ids[-1]
    if last in params.stop_token_ids or (last in eos_token_ids and not params.ignore_eos):
        return ("stop", last)
    return ("length", len(output_ids)) if len(output_ids) >= params.max_new_tokens else None


def _ignores_ignore_eos(output_ids, params, eos_token_ids):
    last = output_ids[-1]
    if len(output_ids) >= params.min_new_tokens and (last in params.stop_token_ids or last in eos_token_ids):
        return ("stop", last)
    return ("length", len(output_ids)) if len(output_ids) >= params.max_new_tokens else None


def _length_first(output_ids, params, eos_token_ids):
    last = output_ids[-1]
    if len(output_ids) >= params.max_new_tokens:
        return ("length", len(output_ids))
    if len(output_ids) >= params.min_new_tokens:
        if last in params.stop_token_ids or (last in eos_token_ids and not params.ignore_eos):
            return ("stop", last)
    return None


def _one_token_too_many(output_ids, params, eos_token_ids):
    last = output_ids[-1]
    if len(output_ids) >= params.min_new_tokens:
        if last in params.stop_token_ids or (last in eos_token_ids and not params.ignore_eos):
            return ("stop", last)
    return ("length", len(output_ids)) if len(output_ids) > params.max_new_tokens else None


def _ignores_stop_token_ids(output_ids, params, eos_token_ids):
    last = output_ids[-1]
    if len(output_ids) >= params.min_new_tokens and last in eos_token_ids and not params.ignore_eos:
        return ("stop", last)
    return ("length", len(output_ids)) if len(output_ids) >= params.max_new_tokens else None


@pytest.mark.parametrize(
    "wrong",
    [_ignores_min_new_tokens, _ignores_ignore_eos, _length_first, _one_token_too_many, _ignores_stop_token_ids],
)
def test_check_finish_rule_rejects_a_wrong_rule(notebook, wrong):
    with pytest.raises(AssertionError, match="Req.check_finished says"):
        notebook["check_finish_rule"](wrong, GENERATIONS, EOS)
