"""mistral: Mistral's calls after [TOOL_CALLS], content before it; both of its forms:

  [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]     (tokenizers before v11)
  [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}     (v11 on; [CALL_ID]id may come
                                                                                   before [ARGS])
Call ids are 9 letters and digits, as Mistral's chat templates require of the calls they read back."""
import json
import random
import string

from kestrel.server.markers import visible
from kestrel.server.tool_parsers.base import ToolParser, json_sequence, raw_json_region

TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_DECODER = json.JSONDecoder()


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def new_id(self):
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def scan(self, text, final):
        i = text.find(TAG)
        if i < 0:
            return [(0, len(visible(text, final, TAG)))], [], False
        rest = text[i + len(TAG):]
        lead = rest.lstrip()
        if lead[:1] in ("[", "{"):
            return [(0, i)], json_sequence(lead[1:] if lead[0] == "[" else lead, final, " \t\r\n,"), False
        pieces = rest.split(TAG)
        pieces[-1] = visible(pieces[-1], final, TAG)
        return [(0, i)], [self._call(p, final or k < len(pieces) - 1) for k, p in enumerate(pieces)], False

    @staticmethod
    def _call(piece: str, complete: bool):
        head, sep, args = piece.partition(ARGS)
        if not sep:
            return raw_json_region(None, None, complete)
        name = head.partition(CALL_ID)[0].strip()
        try:
            start = len(args) - len(args.lstrip())
            _, end = _DECODER.raw_decode(args, start)
            return raw_json_region(name, args[:end], True)
        except ValueError:
            return raw_json_region(name, args, complete)
