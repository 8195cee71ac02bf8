"""pythonic and llama4_pythonic: the whole output is a Python list of calls with keyword arguments (Llama 3.2,
Llama 4 (between <|python_start|> and <|python_end|>), ToolACE):

  [get_weather(city="Paris", days=3), get_time(tz="CET")]

Values are Python literals, read with the ast module (never run); anything else is plain content."""
import ast
import json
import re

from kestrel.server.tool_parsers.base import Region, ToolParser

_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def _literal(text: str):
    """A keyword argument's value: a Python literal, as JSON (ValueError when it is not one)."""
    try:
        value = ast.literal_eval(text.strip())
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
        raise ValueError(text) from e


def _top_level(text: str, pos: int):
    """Yield (index, char) of the characters of text[pos:] outside strings and brackets opened inside it; stops
    after the bracket that closes the one before pos (yielded too)."""
    stack, quote, i = [], None, pos
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = None
        elif c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote) - 1
        elif c in _CLOSERS:
            stack.append(c)
        elif c in ")]}":
            if not stack:
                yield i, c
                return
            stack.pop()
        elif not stack:
            yield i, c
        i += 1


class PythonicToolParser(ToolParser):
    name = "pythonic"
    START, END = "", ""

    def scan(self, text, final):
        body = text.strip()
        if self.START and body.startswith(self.START):
            body = body[len(self.START):].lstrip()
        elif self.START and self.START.startswith(body) and body and not final:
            return [], [], True
        if self.END:
            body = body.split(self.END)[0]
        if not _START.match(body):
            could_be = re.fullmatch(r"(\[\s*([A-Za-z_][\w.]*\s*)?)?", body) and not final
            return ([], [], True) if could_be else ([(0, len(text))], [], False)
        regions, pos, closed = [], 1, False
        while True:
            m = _NAME.match(body, pos)
            if not m:
                break
            name, args, start, done = m.group(1), [], m.end(), False
            for i, c in _top_level(body, start):
                if c in ",)":
                    key, eq, value = body[start:i].partition("=")
                    if eq and key.strip().isidentifier():
                        try:
                            args.append(f"{json.dumps(key.strip())}: {_literal(value)}")
                        except ValueError:
                            return [(0, len(text))], [], False
                    elif body[start:i].strip():  # a positional argument: not this format
                        return [(0, len(text))], [], False
                    start = i + 1
                if c == ")":
                    done = True
                    pos = i + 1
                    break
            regions.append(Region(name, "{" + ", ".join(args) + ("}" if done else ""), done or final,
                                  valid=done))
            if not done:
                break
            rest = body[pos:].lstrip()
            if rest.startswith("]"):
                closed = True
                break
            if not rest.startswith(","):
                break
            pos = len(body) - len(rest) + 1
        if final and not closed:
            return [(0, len(text))], [], False
        return [], regions, False


class Llama4PythonicToolParser(PythonicToolParser):
    name = "llama4_pythonic"
    keeps_special_tokens = True
    START, END = "<|python_start|>", "<|python_end|>"
