"""The tool-call parsers by name, as vLLM's `--tool-call-parser` names them."""

from __future__ import annotations

from kvfleet.runtime.server.tool_calls.hermes import HermesParser
from kvfleet.runtime.server.tool_calls.llama3_json import Llama3JsonParser
from kvfleet.runtime.server.tool_calls.mistral import MistralParser
from kvfleet.runtime.server.tool_calls.parser_base import ToolCallParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser)
}


def get_parser(name: str) -> ToolCallParser:
    """The parser called name; a ValueError listing the known names if there is none."""
    parser = TOOL_CALL_PARSERS.get(name)
    if parser is None:
        known = ", ".join(sorted(TOOL_CALL_PARSERS))
        raise ValueError(f"unknown tool-call parser {name!r}: choose one of {known}")
    return parser()
