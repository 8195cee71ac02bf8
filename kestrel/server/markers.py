"""What the output parsers share (server/tool_parsers/, server/reasoning/): finding marker strings in text that is
still growing, where a marker may be cut across two deltas (its beginning is held back until known); looking a
parser up by name."""
from __future__ import annotations


def partial_suffix(text: str, *tags: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (held back while streaming)."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if tag.startswith(text[-k:]):
                best = k
                break
    return best


def find_first(text: str, tags, start: int = 0) -> tuple[int, str | None]:
    """(index, tag) of the earliest of `tags` in text[start:] (the longest where two start together); (-1, None)."""
    best, which = -1, None
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best or (i == best and len(tag) > len(which))):
            best, which = i, tag
    return best, which


def visible(text: str, final: bool, *tags: str) -> str:
    """`text` less a tail that may be the beginning of one of `tags` (nothing held back once final)."""
    return text if final else text[:len(text) - partial_suffix(text, *tags)]


def blocks(text: str, open_tag: str, close_tag: str, final: bool) -> tuple[list[tuple[int, int]], list[tuple[str, bool]]]:
    """Split text into (spans outside the blocks, [(block body, closed)]): blocks run from `open_tag` to
    `close_tag`; the last may be unclosed (closed once final: the output ended there). Partial tags at the end of
    growing text are held back."""
    spans, bodies, pos = [], [], 0
    while True:
        i = text.find(open_tag, pos)
        if i < 0:
            spans.append((pos, pos + len(visible(text[pos:], final, open_tag))))
            return spans, bodies
        spans.append((pos, i))
        j = text.find(close_tag, i + len(open_tag))
        if j < 0:
            bodies.append((visible(text[i + len(open_tag):], final, close_tag), final))
            return spans, bodies
        bodies.append((text[i + len(open_tag):j], True))
        pos = j + len(close_tag)


def between(text: str, open_tag: str, close_tag: str, final: bool, start: int = 0) -> tuple[str | None, bool, int]:
    """(inside, closed, end) of the first `open_tag`...`close_tag` in text[start:]: None when the opening tag has
    not come; `end` is just past the closing tag (or the end of the text)."""
    i = text.find(open_tag, start)
    if i < 0:
        return None, False, len(text)
    i += len(open_tag)
    j = text.find(close_tag, i)
    if j < 0:
        return visible(text[i:], final, close_tag), final, len(text)
    return text[i:j], True, j + len(close_tag)


def lookup(registry: dict, name: str | None, what: str):
    """A new parser of the registry's class `name` (None for no name); an unknown name is a ValueError of one line
    that names the valid ones."""
    if not name:
        return None
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(registry)}")
    return registry[name]()
