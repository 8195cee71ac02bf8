"""Reasoning parsers (--reasoning-parser): split a `<think>...</think>` model's output into `reasoning_content`
and `content`, whole or as streamed deltas. Text-based, so they work whatever the tags' token ids are.

  qwen3        reasoning only inside <think>...</think> (no tags: all content)
  deepseek_r1  reasoning from the start up to </think> (the chat template opens <think>; the tag may repeat)
"""
from __future__ import annotations

START, END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    starts_in_reasoning = False  # deepseek_r1: the output begins inside the reasoning

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output."""
        s = ReasoningStream(self)
        r1, c1 = s.feed(text)
        r2, c2 = s.feed("", final=True)
        reasoning, content = r1 + r2, c1 + c2
        if not s.saw_reasoning:
            return None, text
        return reasoning, content or None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class ReasoningStream:
    """Feed text deltas; get (reasoning_delta, content_delta). Partial tags at a delta's end are held back."""

    def __init__(self, parser: ReasoningParser):
        self.in_reasoning = parser.starts_in_reasoning
        self.saw_reasoning = parser.starts_in_reasoning
        self.done = False  # </think> seen: the rest is content
        self.pending = ""
        self.at_start = True  # deepseek_r1: an opening <think> at the very start is dropped

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text = self.pending + delta
        self.pending = ""
        reasoning, content = [], []
        while text:
            if self.done:
                content.append(text)
                break
            if self.in_reasoning:
                if self.at_start:
                    if text.startswith(START):
                        text = text[len(START):]
                    elif START.startswith(text) and not final:
                        self.pending = text
                        break
                    self.at_start = False
                    continue
                i = text.find(END)
                if i >= 0:
                    reasoning.append(text[:i])
                    text = text[i + len(END):]
                    self.in_reasoning, self.done = False, True
                    continue
                hold = 0 if final else _partial_suffix(text, END)
                reasoning.append(text[:len(text) - hold])
                self.pending = text[len(text) - hold:]
                break
            i = text.find(START)
            j = text.find(END)
            if j >= 0 and (i < 0 or j < i):  # a closing tag without an opening one: what came before was reasoning
                reasoning.append(text[:j])
                text = text[j + len(END):]
                self.saw_reasoning, self.done = True, True
                continue
            if i >= 0:
                content.append(text[:i])
                text = text[i + len(START):]
                self.in_reasoning = self.saw_reasoning = True
                continue
            hold = 0 if final else max(_partial_suffix(text, START), _partial_suffix(text, END))
            content.append(text[:len(text) - hold])
            self.pending = text[len(text) - hold:]
            break
        return "".join(reasoning), "".join(content)


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if not name:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()
