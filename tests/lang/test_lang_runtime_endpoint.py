"""The same programs through RuntimeEndpoint, over HTTP /generate: against the server's real app,
TokenizerManager, scheduler and detokenizer in this process (fast), and against a real
`python -m labkit.server` that `Runtime` starts (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

import labkit.lang as sgl
from labkit.lang import program


@sgl.function
def interview(s, name, out):
    s += sgl.system("You are a careful interviewer.")
    s += sgl.user(f"My name is {name}. Ask me something.")
    s += sgl.assistant(sgl.gen("question", max_tokens=5))
    s += sgl.user("Is the sky blue? Answer yes or no.")
    s += sgl.assistant("Answer: " + sgl.select("yes_no", choices=["yes", "no"]))
    forks = s.fork(2)
    forks += [sgl.user("Why?"), sgl.user("Why not?")]
    forks += sgl.assistant(sgl.gen("reason", max_tokens=4))
    out.extend(forks)
    forks.join()


def run_interview(backend, name: str = "Ada") -> tuple[sgl.ProgramState, list[sgl.ProgramState]]:
    forks: list[sgl.ProgramState] = []
    return interview.run(name, forks, backend=backend, temperature=0), forks


def assert_same(a: tuple, b: tuple) -> None:
    (state_a, forks_a), (state_b, forks_b) = a, b
    assert state_a.text() == state_b.text()
    assert state_a.messages() == state_b.messages()
    for name in ("question", "yes_no", "reason"):
        assert state_a[name] == state_b[name]
    assert [f.text() for f in forks_a] == [f.text() for f in forks_b]
    scores_a = state_a.get_meta_info("yes_no")["normalized_prompt_logprobs"]
    assert state_b.get_meta_info("yes_no")["normalized_prompt_logprobs"] == pytest.approx(scores_a, abs=1e-4)


def test_a_program_gives_the_same_result_through_the_engine_and_over_http(backend, server_url):
    endpoint = sgl.RuntimeEndpoint(server_url)
    try:
        over_http = run_interview(endpoint)
    finally:
        endpoint.close()
    assert_same(run_interview(backend), over_http)
    state, forks = over_http
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    shared = state.get_meta_info("question")["prompt_tokens"]
    assert all(f.get_meta_info("reason")["cached_tokens"] >= shared for f in forks)  # the radix cache


def test_server_errors_become_exceptions(server_url):
    endpoint = sgl.RuntimeEndpoint(server_url)

    @sgl.function
    def bad(s):
        s += "Hello" + sgl.gen("x", max_tokens=2, regex="(")

    try:
        with pytest.raises(ValueError, match="/generate answered 400"):
            bad.run(backend=endpoint)
    finally:
        endpoint.close()
    with pytest.raises(RuntimeError, match="/generate"):
        bad.run(backend=sgl.RuntimeEndpoint("http://127.0.0.1:9/nothing", timeout_s=2))


@pytest.mark.slow
def test_run_batch_against_a_real_server_started_by_runtime(tiny_engine_kwargs, backend):
    runtime = sgl.Runtime(
        model_path=tiny_engine_kwargs["model_path"],
        load_format="dummy",
        tokenizer_path=tiny_engine_kwargs["tokenizer_path"],
        max_total_tokens=8192,
        device="cpu",
    )
    try:
        batch = [{"name": name, "out": []} for name in ("Ada", "Bob", "Cy")]
        over_http = interview.run_batch(batch, backend=runtime, temperature=0)
    finally:
        assert runtime.shutdown() == 0
    for kwargs, state in zip(batch, over_http):
        assert_same(run_interview(backend, kwargs["name"]), (state, kwargs["out"]))


def test_the_readme_example_runs(server_url, monkeypatch):
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Frontend language", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(program, "_default_backend", None)  # the example sets it
    namespace: dict = {}
    exec(code.replace("http://127.0.0.1:30000", server_url), namespace)
    state = namespace["state"]
    assert state["verdict"] in ("yes", "no") and len(state["retry"]) == 2
