"""labkit.bench.prefill runs end to end on CPU (eager only there) and times one extend step per run."""

from __future__ import annotations

from labkit import Engine
from labkit.bench import prefill


def test_extend_step_ms_times_exactly_the_prefill_of_a_fresh_and_a_cached_prompt():
    engine = Engine(model_path="tiny-llama", load_format="dummy", device="cpu", disable_overlap_schedule=True)
    results = prefill.bench(engine, [8, 40], repeats=2)
    assert set(results) == {8, 40}
    assert all(fresh > 0 and cached > 0 for fresh, cached in results.values())


def test_main_prints_the_eager_column_on_cpu(capsys):
    results = prefill.main(
        [
            "--model-path",
            "tiny-llama",
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--prompt-lens",
            "8",
            "--repeats",
            "1",
        ]
    )
    assert list(results) == ["eager"]
    out = capsys.readouterr().out
    assert "prefill graphs: none on cpu" in out and "| 8 |" in out
