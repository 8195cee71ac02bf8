"""A constraint (kind, spec) as an xgrammar Grammar. Parsing needs no tokenizer, so the frontend uses it to
refuse a bad schema, regex or grammar with a 400 before the request reaches the engine."""
from __future__ import annotations

import functools
import json

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


@functools.lru_cache(maxsize=512)
def check_grammar(kind: str, spec: str, param: str = "structured_outputs") -> None:
    """Raise InvalidRequest naming `param` when xgrammar cannot parse the constraint."""
    try:
        build_grammar(kind, spec)
    except ImportError as e:
        raise InvalidRequest(f"structured outputs need the xgrammar package: {e}", param=param) from e
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if "] " in msg:  # drop xgrammar's "[time] file.cc:line: " prefix
            msg = msg.split(": ", 1)[-1] if ".cc:" in msg else msg
        raise InvalidRequest(f"{param}: the {kind} constraint cannot be compiled: {msg}", param=param) from e
