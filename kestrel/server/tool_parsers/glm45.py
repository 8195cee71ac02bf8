"""glm45: GLM-4.5/4.6/4.7's calls, content before them:

  <tool_call>get_weather
  <arg_key>city</arg_key>
  <arg_value>Paris</arg_value>
  </tool_call>

(GLM-4.7 writes no newline after the name.) A value is read by its schema type in the request's tools; one the
schema does not type is parsed as JSON where it is JSON, as vLLM does."""
from kestrel.server.markers import between
from kestrel.server.tool_parsers.base import BlockToolParser, params_region


class Glm45ToolParser(BlockToolParser):
    name = "glm45"
    keeps_special_tokens = True
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def call(self, body, complete):
        cut = min((i for i in (body.find("\n", len(body) - len(body.lstrip())), body.find("<arg_key>")) if i >= 0),
                  default=-1)
        if cut < 0 and not complete:
            return params_region(None, [], False, self.tools)  # the name may still grow
        name = (body if cut < 0 else body[:cut]).strip()
        params, pos = [], max(cut, 0)
        while True:
            key, key_done, pos = between(body, "<arg_key>", "</arg_key>", complete, pos)
            if key is None or not key_done:
                break
            value, done, pos = between(body, "<arg_value>", "</arg_value>", complete, pos)
            if value is None:
                break
            params.append((key.strip(), value, done))
            if not done:
                break
        return params_region(name or None, params, complete, self.tools, untyped="json")
