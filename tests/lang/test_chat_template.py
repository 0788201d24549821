"""Role blocks read off chat templates: the embedded model's (ChatML with a default system
message), one that leads with BOS (as Llama 3's), and one that cannot be appended to."""

from __future__ import annotations

import pytest

from labkit.lang import ChatTemplate


class FakeTokenizer:
    """A tokenizer whose chat template is a Python function of the messages."""

    chat_template = "(python)"

    def __init__(self, render):
        self.render = render

    def apply_chat_template(self, messages, tokenize: bool, add_generation_prompt: bool) -> str:
        return self.render(messages)


def test_chatml_with_a_default_system_prompt(hf_tokenizer):
    template = ChatTemplate.from_tokenizer(hf_tokenizer)
    assert template.role_prefix_and_suffix == {
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    }
    assert template.default_system_prompt == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert template.first_prefix == ""


def test_a_lead_before_the_first_message_only():
    def llama3(messages):
        turns = (f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>" for m in messages)
        return "<|begin_of_text|>" + "".join(turns)

    template = ChatTemplate.from_tokenizer(FakeTokenizer(llama3))
    assert template.default_system_prompt is None
    assert template.prefix_and_suffix("user", first=True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
        "<|eot_id|>",
    )
    system = template.prefix_and_suffix("system", first=False)
    assert system == ("<|start_header_id|>system<|end_header_id|>\n\n", "<|eot_id|>")


def test_a_template_that_does_not_grow_message_by_message_is_refused():
    def system_last(messages):
        system = [m["content"] for m in messages if m["role"] == "system"]
        return "".join(f"[{m['role']}] {m['content']}\n" for m in messages if m["role"] != "system") + "".join(system)

    with pytest.raises(ValueError, match="one after another"):
        ChatTemplate.from_tokenizer(FakeTokenizer(system_last))
