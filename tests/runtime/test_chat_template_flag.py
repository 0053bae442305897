"""`--chat-template`: a file or an inline Jinja template replaces the tokenizer's own (here, to
render tools for a model whose template has none); anything else is a start-up error naming
the flag, as are the tool flags given without each other."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvfleet.runtime.engine.config import ConfigError, EngineConfig

TEMPLATE = Path(__file__).with_name("hermes_tool_template.jinja")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_a_file_or_an_inline_template_is_taken_and_anything_else_refused(tmp_path):
    assert EngineConfig(chat_template=str(TEMPLATE)).chat_template == TEMPLATE.read_text()
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert EngineConfig(chat_template=inline).chat_template == inline
    with pytest.raises(ConfigError, match=r"chat_template: .*neither a readable file"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    plain = tmp_path / "plain.txt"
    plain.write_text("no template here")
    with pytest.raises(ConfigError, match="holds no Jinja template"):
        EngineConfig(chat_template=str(plain))


def test_the_template_renders_the_tools_offered(tiny_llama_dir):
    from kvfleet.runtime import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128,
              kv_cache_memory="16MiB", chat_template=str(TEMPLATE))  # fmt: skip
    text = llm.engine.render_chat([{"role": "user", "content": "Weather?"}], tools=TOOLS)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_auto_tool_choice_without_a_parser_is_a_start_up_error():
    run = subprocess.run(
        [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--enable-auto-tool-choice"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in run.stderr
