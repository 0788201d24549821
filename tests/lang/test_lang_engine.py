"""labkit.lang programs on an in-process Engine (the tiny random-weight model with the embedded
tokenizer): select against logprobs computed directly, constrained gen, roles in the chat template,
forks on the radix cache, run_batch, and the errors of bad programs."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

import labkit.lang as sgl
from labkit.lang import program


def direct_normalized_logprob(engine, prefix: str, choice: str) -> float:
    """The mean logprob of the tokens of prefix + choice past its common token prefix with prefix."""
    tok = engine.tokenizer
    before, after = tok(prefix)["input_ids"], tok(prefix + choice)["input_ids"]
    start = next(i for i, (a, b) in enumerate(zip(before + [-1], after)) if a != b)
    params = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": start}
    pairs = engine.generate(prefix + choice, params)["meta_info"]["input_token_logprobs"]
    return sum(lp for lp, _ in pairs) / len(pairs)


@pytest.mark.parametrize(
    "prefix, choices",
    [
        ("The colour of the sky is", [" blue", " green", " a deep shade of red"]),
        ("Answer: ", ["Paris", "London", "Rome"]),  # the choice merges with the trailing space
    ],
)
def test_select_picks_the_highest_normalized_prompt_logprob(engine, backend, prefix, choices):
    @sgl.function
    def pick(s):
        s += prefix
        s += sgl.select("x", choices=choices)

    state = pick.run(backend=backend)
    scores = state.get_meta_info("x")["normalized_prompt_logprobs"]
    expected = [direct_normalized_logprob(engine, prefix, c) for c in choices]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert state["x"] == choices[max(range(len(choices)), key=expected.__getitem__)]
    assert state.text() == prefix + state["x"]


def test_gen_with_regex_and_json_schema(backend):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "name": {"type": "string", "maxLength": 6}},
        "required": ["ok", "name"],
        "additionalProperties": False,
    }

    @sgl.function
    def structured(s):
        s += "Three digits: " + sgl.gen("digits", max_tokens=8, regex=r"[0-9]{3}")
        s += "\nJSON: " + sgl.gen("obj", max_tokens=48, json_schema=json.dumps(schema))

    state = structured.run(backend=backend, temperature=0)
    assert re.fullmatch(r"[0-9]{3}", state["digits"])
    jsonschema.validate(json.loads(state["obj"]), schema)
    assert state.get_meta_info("obj")["finish_reason"]["type"] == "stop"


def test_roles_render_the_chat_template_and_gen_answers_as_a_chat_request(engine, backend):
    @sgl.function
    def chat(s, question):
        s += sgl.system("You are terse.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=6))

    state = chat.run(question="Hi?", backend=backend, temperature=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi?"}]
    direct = engine.generate(messages=messages, sampling_params={"temperature": 0, "max_new_tokens": 6})
    assert state["answer"] == direct["text"]
    assert state.text() == engine.apply_chat_template(messages) + direct["text"] + "<|im_end|>\n"
    assert state.messages() == [*messages, {"role": "assistant", "content": direct["text"].lstrip()}]


def test_a_conversation_opening_with_a_user_message_gets_the_default_system_prompt(engine, backend):
    @sgl.function
    def chat(s):
        s += sgl.user_begin() + "Hello" + sgl.user_end()
        s += sgl.assistant_begin()

    state = chat.run(backend=backend)
    assert state.text() == engine.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert [m["role"] for m in state.messages()] == ["system", "user"]


def test_forks_continue_independently_and_reuse_the_shared_prefix(backend):
    @sgl.function
    def branches(s, out):
        s += "A long shared introduction that every branch starts from, " * 4 + sgl.gen("intro", max_tokens=2)
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" Branch {i}:" + sgl.gen("detail", max_tokens=3)
        out.extend(forks)
        forks.join()

    forks: list = []
    state = branches.run(forks, backend=backend, temperature=0)
    assert state["detail"] == [f["detail"] for f in forks]  # gathered by join
    for i, f in enumerate(forks):
        assert f.text() == state.text() + f" Branch {i}:" + f["detail"]
        # The gen before the fork left the shared text in the radix cache (the last token may
        # tokenize differently once text follows it).
        assert f.get_meta_info("detail")["cached_tokens"] >= state.get_meta_info("intro")["prompt_tokens"] - 1


def test_branches_run_at_once_find_the_prefix_the_fork_sent(engine, backend):
    @sgl.function
    def branches(s, out):
        s += "Plain text, never generated from, shared by both branches. " * 4
        forks = s.fork(2)
        forks += sgl.gen("x", max_tokens=2)  # both branches' requests at once
        out.extend(forks)

    forks: list = []
    state = branches.run(forks, backend=backend, temperature=0)
    prefix_tokens = len(engine.tokenizer(state.text())["input_ids"])
    assert all(f.get_meta_info("x")["cached_tokens"] >= prefix_tokens - 1 for f in forks)


def test_fork_group_forms_and_joins(backend):
    state = sgl.ProgramState(backend, {})
    state += "root:"
    state["kept"] = "root"
    forks = state.fork(3)
    forks += lambda i: f"<{i}>"
    forks[1] += "more"
    for f, name in zip(forks, ["a", "b", "c"]):
        f["kept"], f["name"] = "changed", name
    forks.join()
    assert state["kept"] == "root" and state["name"] == ["a", "b", "c"]  # SGLang: only new names gather
    assert [f.text() for f in forks] == ["root:<0>", "root:<1>more", "root:<2>"]
    forks.join("concate_and_append")
    assert state.text() == "root:<0><1>more<2>"
    with state.copy() as c:
        c["inner"] = "x"
    assert state["inner"] == ["x"]
    with pytest.raises(TypeError, match="cannot be replaced"):
        forks[0] = forks[1]


def test_role_methods_on_the_state(engine, backend):
    state = sgl.ProgramState(backend, {})
    state.system("Be brief.")
    with state.user():
        state += "Hi"
    state += sgl.assistant_begin()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert state.text() == engine.apply_chat_template(messages)
    assert state.messages() == messages


def test_run_batch_returns_states_in_order(backend):
    @sgl.function
    def item(s, i):
        s += f"Item {i}:" + sgl.gen("x", max_tokens=3)

    states = item.run_batch([{"i": i} for i in range(5)], backend=backend, temperature=0)
    assert [s.text().split(":")[0] for s in states] == [f"Item {i}" for i in range(5)]
    assert all(s.get_meta_info("x")["completion_tokens"] == 3 for s in states)


def test_set_default_backend_takes_an_engine(engine, monkeypatch):
    monkeypatch.setattr(program, "_default_backend", None)

    @sgl.function
    def hello(s):
        s += "Hello" + sgl.gen("x", max_tokens=1)

    with pytest.raises(RuntimeError, match="no backend"):
        hello.run()
    sgl.set_default_backend(engine)
    assert hello.run(temperature=0).get_meta_info("x")["completion_tokens"] == 1


def test_bad_uses_raise_clear_errors(backend):
    with pytest.raises(ValueError, match="non-empty list"):
        sgl.select("x", choices=[])
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", regex="a", json_schema="{}")
    with pytest.raises(TypeError, match="not int"):
        sgl.gen("x") + 3
    with pytest.raises(TypeError, match="first parameter"):
        sgl.function(lambda: None)
    with pytest.raises(TypeError, match="backend"):
        sgl.set_default_backend("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        sgl.EngineBackend(SimpleNamespace(tokenizer=None))
    with pytest.raises(ValueError, match="chat template"):
        sgl.ChatTemplate.from_tokenizer(None)

    @sgl.function
    def prog(s, q):
        s += q

    with pytest.raises(TypeError, match=r"prog\(q\): missing a required argument: 'q'"):
        prog.run(backend=backend, question="?")
    with pytest.raises(TypeError, match="list of keyword"):
        prog.run_batch({"q": "?"}, backend=backend)

    state = sgl.ProgramState(backend, {})
    with pytest.raises(ValueError, match="without an open user"):
        state += sgl.user_end()
    state += sgl.user_begin()
    with pytest.raises(ValueError, match="inside the open user"):
        state += sgl.assistant_begin()
    with pytest.raises(KeyError, match="no variable 'missing'"):
        state["missing"]
    with pytest.raises(ValueError, match="size >= 1"):
        state.fork(0)
    with pytest.raises(ValueError, match="temperature"):
        state += sgl.gen("x", temperature=-1.0)
