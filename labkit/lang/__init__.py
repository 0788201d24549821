"""labkit's frontend language, SGLang's API: a program written for `sglang` runs on labkit with
`import labkit.lang as sgl`.

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=32))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))  # or a labkit Engine
    print(qa.run(question="What is 2 + 2?", temperature=0)["answer"])
"""

from labkit.lang.backend import Backend, EngineBackend
from labkit.lang.chat_template import ChatTemplate
from labkit.lang.interpreter import ProgramState, ProgramStateGroup
from labkit.lang.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from labkit.lang.program import SglFunction, function, set_default_backend
from labkit.lang.runtime import Runtime
from labkit.lang.runtime_endpoint import RuntimeEndpoint

__all__ = [
    "Backend",
    "ChatTemplate",
    "EngineBackend",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "SglFunction",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "user",
    "user_begin",
    "user_end",
]
