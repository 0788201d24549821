"""profile_step's kernel groups: every kernel labkit launches lands in the group named for it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from labkit.bench.profile_step import GROUPS, group_of


def _triton_kernel_names() -> set[str]:
    """Names of the @triton.jit kernels (not helpers) defined in labkit.kernels."""
    import labkit.kernels as pkg

    names = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        names.update(re.findall(r"@triton\.jit\ndef (_\w+_kernel)\(", path.read_text()))
    return names


@pytest.mark.parametrize(
    "kernel, group",
    [
        ("_decode_stage1_kernel", "attention, decode"),
        ("_decode_stage2_kernel", "attention, decode"),
        ("_extend_kernel", "attention, extend"),
        ("_store_kv_kernel", "kv store"),
        ("_decode_balanced_kernel", "attention, decode"),
        ("_rmsnorm_kernel", "rmsnorm"),
        ("_rope_kernel", "rotary (+ q/k norm)"),
        ("_silu_and_mul_kernel", "silu_and_mul"),
        ("nvjet_sm90_tst_64x32_64x16_1x2_h_bz_TNT", "matmul"),
        (
            (
                "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::BFloat16, "
                "at::native::ArgMaxOps<float>, unsigned int, long, 4, 4> >"
            ),
            "argmax / sampling",
        ),
        ("Memcpy DtoD (Device -> Device)", "copies / casts / indexing"),
    ],
)
def test_kernel_names_map_to_their_group(kernel, group):
    assert group_of(kernel) == group


def test_every_labkit_triton_kernel_has_a_group():
    names = _triton_kernel_names()
    assert len(names) >= 7
    assert all(group_of(name) != "other" for name in names), sorted(n for n in names if group_of(n) == "other")
    assert len({name for name, _ in GROUPS}) == len(GROUPS)
