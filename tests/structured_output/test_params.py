"""StructuredOutputsParams: validation names the field; the params survive the msgspec wire."""
import msgspec
import pytest

from kestrel.ipc.protocol import EngineCoreRequest, add_decoder, encoder
from kestrel.core.sampling_params import SamplingParams, StructuredOutputsParams as SO
from kestrel.errors import InvalidRequest


@pytest.mark.parametrize("so, field", [
    (SO(), "structured_outputs"),
    (SO(regex="a+", choice=["a"]), "structured_outputs"),
    (SO(regex="(unclosed"), "structured_outputs"),
    (SO(json='{"type": "nonsense"}'), "structured_outputs"),
    (SO(json="{not json"), "structured_outputs"),
    (SO(json="[1, 2]"), "structured_outputs"),
    (SO(choice=[]), "structured_outputs"),
    (SO(choice=["a", ""]), "structured_outputs"),
    (SO(grammar='root ::= undefined_rule'), "structured_outputs"),
])
def test_bad_constraints_raise_invalid_request(so, field):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(structured_outputs=so).validate()
    assert e.value.param == field
    assert e.value.status_code == 400


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("so, match", [
    (SO(json={"type": "string", "pattern": "a{1000000}"}), r"schema\.pattern repeats 1000000 times"),
    (SO(json={"type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]{2,50000}"}}}),
     r"schema\.properties\.x\.pattern repeats 50000"),
    (SO(json={"type": "object", "patternProperties": {"^b{5000}$": {}}}), "patternProperties repeats 5000"),
    (SO(regex="x{1001}"), "the regex repeats 1001 times"),
    (SO(regex="a" * 300_000), "the regex constraint has 300000 characters; at most 262144"),
    (SO(json=_nested(200)), "nests deeper than 64 levels"),
    (SO(json={"$ref": "https://example.com/schema.json"}), r"\$ref 'https://example.com/schema.json' points outside"),
    (SO(json={"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}), "points outside the schema"),
])
def test_hostile_constraints_are_refused_before_parsing(so, match, monkeypatch):
    """Issue 33: a 41-byte schema whose pattern repeats a million times parsed for minutes (the time grows with
    the square of the count); a remote $ref was accepted. Both are refused before xgrammar sees them."""
    import kestrel.core.grammar as grammar

    monkeypatch.setattr(grammar, "build_grammar", lambda *a: pytest.fail("parsed a refused constraint"))
    grammar.check_grammar.cache_clear()
    with pytest.raises(InvalidRequest, match=match) as e:
        so.validate("response_format")
    assert e.value.param == "response_format"


def test_limits_keep_ordinary_constraints():
    SO(json=_nested(20)).validate()
    SO(json={"type": "object", "properties": {"zip": {"type": "string", "pattern": r"^\d{5}(-\d{4})?$"},
                                              "id": {"$ref": "#/$defs/id"}},
             "$defs": {"id": {"type": "string", "pattern": "[a-f0-9]{1000}"}}}).validate()
    SO(regex=r"\{10000\}x{3,}").validate()  # an escaped brace is a literal, not a repeat


def test_bad_regex_message_says_why():
    with pytest.raises(InvalidRequest, match="regex.*parenthesis"):
        SO(regex="(a").validate()


def test_good_constraints_and_kinds():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    cases = [(SO(json=schema), "json"), (SO(regex=r"\d+"), "regex"), (SO(choice=["x", 'y"z']), "choice"),
             (SO(grammar='root ::= "a" | "b"'), "grammar"), (SO(json_object=True), "json_object")]
    for so, kind in cases:
        SamplingParams(structured_outputs=so).validate()
        assert so.kind == kind
    assert list(msgspec.json.decode(cases[0][0].spec)["properties"]) == ["b", "a"]  # property order is kept


def test_dict_form_and_unknown_fields():
    p = SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert isinstance(p.structured_outputs, SO) and p.structured_outputs.kind == "regex"
    with pytest.raises(InvalidRequest, match="unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a"})


def test_survives_the_wire():
    p = SamplingParams(max_tokens=5, structured_outputs=SO(json={"type": "object"}))
    r = EngineCoreRequest("r", [1, 2], p, 5, 0.0)
    back = add_decoder.decode(encoder.encode(r))
    assert back.sampling_params.structured_outputs == p.structured_outputs
    assert back.sampling_params.structured_outputs.kind == "json"
