"""qwen3_coder, qwen3_xml: Qwen3-Coder's and Qwen3.5's XML-style calls, content before them:

  <tool_call>
  <function=get_weather>
  <parameter=city>
  Paris
  </parameter>
  </function>
  </tool_call>

A parameter's text (less one newline each side) becomes the JSON value its schema type in the request's tools
says: integers, numbers, booleans, objects and arrays parsed, strings kept, "null" null."""
from kestrel.server.markers import blocks, visible
from kestrel.server.tool_parsers.base import BlockToolParser, params_region


def tag_params(body: str, open_tag: str, close_tag: str, complete: bool) -> list[tuple[str, str, bool]]:
    """(key, value text, closed) of `open_tag`KEY>VALUE`close_tag` parameters (the key may be quoted)."""
    params = []
    for inner, closed in blocks(body, open_tag, close_tag, complete)[1]:
        key, sep, value = inner.partition(">")
        if not sep:
            break  # the key is still being written
        params.append((key.strip().strip("'\""), value, closed))
    return params


class Qwen3CoderToolParser(BlockToolParser):
    name = "qwen3_coder"
    keeps_special_tokens = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def call(self, body, complete):
        head, sep, rest = body.partition("<function=")
        name, gt, params = rest.partition(">")
        if not sep or not gt:
            return params_region(None, [], complete, self.tools)
        params = visible(params, complete, "</function>")
        return params_region(name.strip(), tag_params(params, "<parameter=", "</parameter>", complete), complete,
                             self.tools)


class Qwen3XmlToolParser(Qwen3CoderToolParser):
    name = "qwen3_xml"
