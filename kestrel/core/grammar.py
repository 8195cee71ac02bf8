"""A constraint (kind, spec) as an xgrammar Grammar. Parsing needs no tokenizer, so the frontend uses it to
refuse a bad schema, regex or grammar with a 400 before the request reaches the engine."""
from __future__ import annotations

import functools
import json
import re

from kestrel.errors import InvalidRequest

# Compact JSON (no free whitespace): small models otherwise tend to emit newlines until max_tokens.
JSON_SCHEMA_OPTIONS = dict(any_whitespace=False, strict_mode=True)


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a double-quoted literal; xgrammar's EBNF reads JSON escapes


def build_grammar(kind: str, spec: str):
    import xgrammar as xgr

    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, **JSON_SCHEMA_OPTIONS)
    if kind == "json_object":  # OpenAI's json_object: an object (xgrammar's builtin JSON grammar takes any value)
        return xgr.Grammar.from_json_schema('{"type": "object"}', **JSON_SCHEMA_OPTIONS)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in json.loads(spec)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    raise ValueError(f"unknown structured output kind {kind!r}")


# xgrammar's JSON-schema converter takes time quadratic in a pattern's repeat count (a{10000}: 5 s, a{30000}:
# 66 s, from a 41-byte schema), so a larger count is refused before parsing; the parse budget
# (kestrel/server/grammar_check.py, --grammar-parse-timeout) catches what gets past this.
MAX_REPEAT = 1000
MAX_SPEC_CHARS = 256 * 1024  # a constraint's text (a schema of many tools stays well under)
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in a schema (each level is a recursion here and in xgrammar)
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _check_repeats(regex: str, param: str, where: str) -> None:
    for m in _REPEAT.finditer(regex):
        count = max(int(g) for g in m.groups() if g)
        if count > MAX_REPEAT:
            raise InvalidRequest(f"{param}: {where} repeats {count} times ({m.group(0)}); at most {MAX_REPEAT} "
                                 f"are allowed", param=param)


def _check_schema(node, param: str, path: str = "schema", depth: int = 0) -> None:
    """Refuse what a schema may not hold: a $ref outside the document (never fetched), patterns with repeat
    counts over MAX_REPEAT, nesting deeper than MAX_SCHEMA_DEPTH."""
    if not isinstance(node, (list, dict)):
        return
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (at {path[:200]})",
                             param=param)
    if isinstance(node, list):
        for i, v in enumerate(node):
            _check_schema(v, param, f"{path}[{i}]", depth + 1)
        return
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
            raise InvalidRequest(f"{param}: {path}.$ref {value!r} points outside the schema; only local "
                                 f"references ('#/...') are allowed", param=param)
        if key == "pattern" and isinstance(value, str):
            _check_repeats(value, param, f"{path}.pattern")
        if key == "patternProperties" and isinstance(value, dict):
            for pattern in value:
                _check_repeats(pattern, param, f"{path}.patternProperties")
        _check_schema(value, param, f"{path}.{key}", depth + 1)


def check_limits(kind: str, spec: str, param: str = "structured_outputs") -> None:
    """The cheap checks before xgrammar parses a constraint (milliseconds, fine on an event loop)."""
    if len(spec) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"{param}: the {kind} constraint has {len(spec)} characters; at most {MAX_SPEC_CHARS} "
                             f"are allowed", param=param)
    if kind == "json":
        _check_schema(json.loads(spec), param)
    elif kind == "regex":
        _check_repeats(spec, param, "the regex")


@functools.lru_cache(maxsize=2048)
def check_grammar(kind: str, spec: str, param: str = "structured_outputs") -> None:
    """Raise InvalidRequest naming `param` when xgrammar cannot parse the constraint (or it is over the limits)."""
    check_limits(kind, spec, param)
    try:
        build_grammar(kind, spec)
    except ImportError as e:
        raise InvalidRequest(f"structured outputs need the xgrammar package: {e}", param=param) from e
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if "] " in msg:  # drop xgrammar's "[time] file.cc:line: " prefix
            msg = msg.split(": ", 1)[-1] if ".cc:" in msg else msg
        raise InvalidRequest(f"{param}: the {kind} constraint cannot be compiled: {msg}", param=param) from e
