"""What every reasoning parser shares: split a model's output into `reasoning_content` and `content`, whole or as
streamed deltas. Text-based, so they work whatever the tags' token ids are. A tag parser is a few class
attributes: the tags that open and close the reasoning (alternatives allowed), whether the output begins inside
it (the chat template opened it), markers that end it but belong to the content (a tool-call section), and
wrapper tags dropped from the content. Partial tags at a delta's end are held back."""
from __future__ import annotations

from kestrel.server.markers import find_first, partial_suffix


class ReasoningParser:
    starts: tuple[str, ...] = ("<think>",)
    ends: tuple[str, ...] = ("</think>",)
    ends_kept: tuple[str, ...] = ()  # end the reasoning and stay in the content (Kimi K2's tool-call section)
    starts_in_reasoning = False  # deepseek_r1: the output begins inside the reasoning
    content_drops: tuple[str, ...] = ()  # wrapper tags taken out of the content (<answer>, <response>)
    keeps_special_tokens = False  # its tags are special tokens of the model's vocabulary: decode them
    framed = False  # all output is in the format's frames (harmony): the content is unwrapped, reasoning or not

    def for_request(self, chat_template_kwargs: dict | None) -> "ReasoningParser | None":
        """The parser for one request (None: this request's output has no reasoning part)."""
        return self

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output."""
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.feed("", final=True)
        reasoning, content = r1 + r2, c1 + c2
        if not s.saw_reasoning:
            return None, (content or None) if self.framed else text
        return reasoning, content or None

    def stream(self):
        return ReasoningStream(self)


class ReasoningStream:
    """Feed text deltas; get (reasoning_delta, content_delta)."""

    def __init__(self, parser: ReasoningParser):
        self.p = parser
        self.in_reasoning = parser.starts_in_reasoning
        self.saw_reasoning = parser.starts_in_reasoning
        self.done = False  # the reasoning ended: the rest is content
        self.pending = ""
        self.at_start = True  # starts_in_reasoning: an opening tag at the very start is dropped
        self.content_started = False

    def _content(self, text: str, final: bool) -> str:
        """Content after the reasoning, less the parser's wrapper tags (a partial one held back)."""
        drops = self.p.content_drops
        if not drops:
            return text
        for tag in drops:
            text = text.replace(tag, "")
        hold = 0 if final else partial_suffix(text, *drops)
        self.pending = text[len(text) - hold:]
        text = text[:len(text) - hold]
        if not self.content_started:
            text = text.lstrip("\n")
            self.content_started = bool(text)
        return text

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        p = self.p
        text = self.pending + delta
        self.pending = ""
        reasoning, content = [], []
        while text:
            if self.done:
                content.append(self._content(text, final))
                break
            if self.in_reasoning:
                if self.at_start:
                    i, tag = find_first(text, p.starts)
                    if i == 0:
                        text = text[len(tag):]
                    elif not final and partial_suffix(text, *p.starts) == len(text):
                        self.pending = text
                        break
                    self.at_start = False
                    continue
                i, tag = find_first(text, p.ends + p.ends_kept)
                if i >= 0:
                    reasoning.append(text[:i])
                    text = text[i:] if tag in p.ends_kept else text[i + len(tag):]
                    self.in_reasoning, self.done = False, True
                    continue
                hold = 0 if final else partial_suffix(text, *p.ends, *p.ends_kept)
                reasoning.append(text[:len(text) - hold])
                self.pending = text[len(text) - hold:]
                break
            i, start = find_first(text, p.starts)
            j, end = find_first(text, p.ends)
            if j >= 0 and (i < 0 or j < i):  # a closing tag without an opening one: what came before was reasoning
                reasoning.append(text[:j])
                text = text[j + len(end):]
                self.saw_reasoning, self.done = True, True
                continue
            if i >= 0:
                content.append(text[:i])
                text = text[i + len(start):]
                self.in_reasoning = self.saw_reasoning = True
                continue
            hold = 0 if final else partial_suffix(text, *p.starts, *p.ends)
            content.append(text[:len(text) - hold])
            self.pending = text[len(text) - hold:]
            break
        return "".join(reasoning), "".join(content)


class SnapshotReasoningParser(ReasoningParser):
    """A parser that re-reads the whole output so far (split); its stream sends what each reading added."""

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        """(reasoning so far, content so far, saw reasoning): each only ever grows as the text does."""
        raise NotImplementedError

    def stream(self):
        return SnapshotStream(self)


class SnapshotStream:
    def __init__(self, parser: SnapshotReasoningParser):
        self.p, self.text, self.sent = parser, "", (0, 0)
        self.saw_reasoning = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content, self.saw_reasoning = self.p.split(self.text, final)
        r, c = self.sent
        self.sent = (max(r, len(reasoning)), max(c, len(content)))
        return reasoning[r:], content[c:]
