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
