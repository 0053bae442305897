"""Structured outputs: what a request may ask its text to be (a JSON schema, any JSON object, a
regex, one of some strings, an EBNF grammar), turned into the grammar the engine core enforces
token by token (grammar_matchers.py).

The grammar engine is xgrammar (what vLLM, SGLang and TensorRT-LLM use): it fills a step's
token mask in microseconds per request and caches compiled grammars. A request's constraint is
converted here, in the input processor, so a bad schema is the client's 400 before anything is
queued; the core receives the converted grammar in xgrammar's own serialized form and only
compiles it against the vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# JSON-schema keywords xgrammar accepts but does not enforce: a schema that uses them would
# get output that does not validate, so it is refused by name instead.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else")
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot enforce; `field` names which part of it (json,
    regex, choice, grammar) so the HTTP layer can name the request's own field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's `StructuredOutputsParams`). `json` is a schema given as
    JSON text or a dict (kept as JSON text: what the engine core is sent is the converted
    grammar, and text holds any JSON number); `whitespace` lets JSON carry any indentation
    (off: compact JSON, which small models cannot pad without end)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # EBNF, in xgrammar's (GBNF-like) syntax
    json_object: bool = False
    whitespace: bool = False

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise StructuredOutputError(
                "structured_outputs",
                f"give exactly one of json, regex, choice, grammar, json_object; got "
                f"{', '.join(given) or 'none'}",
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", json.dumps(self.json))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, spec text, whitespace): what the converted grammar depends on."""
        if self.json is not None:
            return ("json", str(self.json), self.whitespace)
        if self.regex is not None:
            return ("regex", self.regex, False)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice), False)
        if self.grammar is not None:
            return ("grammar", self.grammar, False)
        return ("json_object", "", self.whitespace)


def warm_grammar_engine() -> None:
    """Import the grammar engine and convert one grammar (the import takes a moment)."""
    grammar_of(StructuredOutputsParams(json_object=True))


def grammar_of(params: StructuredOutputsParams) -> str:
    """The constraint as a serialized xgrammar Grammar (StructuredOutputError when it cannot be
    enforced). Cached: clients send the same few schemas again and again."""
    return _convert(*params.key)


@lru_cache(maxsize=512)
def _convert(kind: str, spec: str, whitespace: bool) -> str:
    import xgrammar as xgr

    if len(spec) > MAX_SPEC_CHARS:
        raise StructuredOutputError(kind, f"at most {MAX_SPEC_CHARS} characters, got {len(spec)}")
    try:
        if kind == "json":
            _check_schema(spec)
            grammar = xgr.Grammar.from_json_schema(
                spec, any_whitespace=whitespace, strict_mode=True
            )
        elif kind == "json_object":
            grammar = (
                xgr.Grammar.builtin_json_grammar()
                if whitespace
                else xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            )
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            grammar = _choice_grammar(json.loads(spec))
        else:
            grammar = xgr.Grammar.from_ebnf(spec)
    except StructuredOutputError:
        raise
    except (RuntimeError, ValueError) as exc:
        raise StructuredOutputError(kind, _engine_message(exc)) from None
    if _matches_nothing(grammar):
        raise StructuredOutputError(
            kind, "matches no text at all (its first character can be none)"
        )
    return grammar.serialize_json()


@lru_cache(maxsize=1)
def _byte_compiler() -> Any:
    """A grammar compiler for a vocabulary of the 256 single bytes, which can write any text:
    a grammar that allows none of them first allows no text."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)], xgr.VocabType.RAW, vocab_size=256)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _matches_nothing(grammar: Any) -> bool:
    """Whether no text at all satisfies the grammar (e.g. the regex `[^\\x00-\\U0010FFFF]`):
    checked at its first character, in about a millisecond."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(
        _byte_compiler().compile_grammar(grammar), terminate_without_stop_token=True
    )
    mask = xgr.allocate_token_bitmask(1, 256)
    matcher.fill_next_token_bitmask(mask)
    return not bool(mask.any()) and not matcher.is_completed()


def _check_schema(spec: str) -> None:
    """A schema must be a JSON object that is a valid JSON Schema and uses only what the
    grammar engine enforces."""
    from kvfleet.runtime.engine.schema_check import schema_problem

    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError("json", f"is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise StructuredOutputError("json", "a JSON schema must be an object")
    problem = schema_problem(schema)
    if problem is not None:
        raise StructuredOutputError(
            "json", f"is not a valid JSON Schema at {problem.pointer}: {problem.message[:200]}"
        )
    for path, keyword in _unenforced(schema, "#"):
        raise StructuredOutputError(
            "json",
            f"uses {keyword!r} at {path}, which structured outputs cannot enforce (the "
            f"unsupported keywords: {', '.join(UNENFORCED_KEYWORDS)}, and allOf with more "
            f"than one schema)",
        )


# Keywords whose value maps names to schemas (a property called "not" is no keyword), and
# those whose value is data, not a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("enum", "const", "default", "examples")


def _unenforced(node: Any, path: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for keyword in UNENFORCED_KEYWORDS:
            if keyword in node and isinstance(node[keyword], dict | bool):
                found.append((path, keyword))
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            found.append((path, "allOf"))
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for name, schema in value.items():
                    found.extend(_unenforced(schema, f"{path}/{key}/{name}"))
            elif key not in _DATA:
                found.extend(_unenforced(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found.extend(_unenforced(value, f"{path}/{i}"))
    return found


def _choice_grammar(choices: list[Any]) -> Any:
    import xgrammar as xgr

    if not choices or len(choices) > MAX_CHOICES:
        raise StructuredOutputError(
            "choice", f"must hold 1 to {MAX_CHOICES} strings, got {len(choices)}"
        )
    if not all(isinstance(c, str) and c for c in choices):
        raise StructuredOutputError("choice", "must hold non-empty strings")
    # JSON's string escapes are the EBNF literal's, so each choice is written as JSON.
    return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in choices))


def _engine_message(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location ("[time] file.cc:123: ...")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text[:300]
