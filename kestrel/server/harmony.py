"""OpenAI's harmony format (gpt-oss), read from text: the output is messages, each a header up to <|message|>
(the first one's begins at <|channel|>: the prompt ends with <|start|>assistant) and a body up to <|end|>,
<|call|>, <|return|> or the next header. The header names the channel (analysis: reasoning; commentary: calls
and preambles; final: the answer) and, for a call, the recipient (to=functions.get_weather):

  <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
  to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

Shared by the openai tool parser and the openai_gptoss reasoning parser."""
from __future__ import annotations

import re
from dataclasses import dataclass

from kestrel.server.markers import find_first, visible

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
HEADS = (START, CHANNEL)
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass
class Piece:
    start: int  # where it begins (a message: its header)
    body: tuple[int, int]  # plain text: the same span; a message: its body
    end: int  # just past it (a message: past its terminator where it has one)
    complete: bool = True
    channel: str | None = None  # None: plain text outside any message
    recipient: str | None = None


def pieces(text: str, final: bool) -> list[Piece]:
    """The plain text and messages of the output so far; a header still being written is left out (held)."""
    out, pos = [], 0
    while pos < len(text):
        h, _ = find_first(text, HEADS, pos)
        if h < 0:
            end = pos + len(visible(text[pos:], final, *HEADS, *ENDS))
            out.append(Piece(pos, (pos, end), end))
            break
        if h > pos:
            out.append(Piece(pos, (pos, h), h))
        m = text.find(MESSAGE, h)
        if m < 0:
            break  # the header is still being written
        header, b = text[h:m], m + len(MESSAGE)
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        e, tag = find_first(text, ENDS + HEADS, b)
        if e < 0:
            end = b + len(visible(text[b:], final, *ENDS, *HEADS))
            out.append(Piece(h, (b, end), end, final, channel.group(1) if channel else "",
                             recipient.group(1) if recipient else None))
            break
        end = e + len(tag) if tag in ENDS else e
        out.append(Piece(h, (b, e), end, True, channel.group(1) if channel else "",
                         recipient.group(1) if recipient else None))
        pos = end
    return out
