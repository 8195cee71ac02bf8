"""vLLM's `truncate_prompt_tokens`: keep only the last k tokens of a prompt (left truncation), for generation and
pooling requests alike; -1 means the model's context length (max_model_len). None: the prompt as given. A
cross-encoder's text pair is cut by its tokenizer instead (frontend/pooling.py pair_token_ids: longest text first,
keeping [CLS] and the [SEP]s), as vLLM tokenizes pairs with truncation to k tokens."""
from __future__ import annotations

from kestrel.errors import InvalidRequest

PARAM = "truncate_prompt_tokens"


def check_truncation(k) -> None:
    """None, -1 or a positive integer (a 400 naming the parameter otherwise)."""
    if k is None:
        return
    if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
        raise InvalidRequest(f"{PARAM} must be a positive integer, or -1 for the model's context length; got {k!r}",
                             param=PARAM)


def special_token_span(tokenizer) -> tuple[int, int]:
    """How many special tokens the tokenizer puts before and after a text ([CLS] / [SEP], a BOS): (0, 0) where
    it adds none or they cannot be told apart."""
    if tokenizer is None:
        return 0, 0
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if plain and full[start:start + len(plain)] == plain:
            return start, len(full) - start - len(plain)
    return 0, 0


def truncate_prompt(ids: list[int], k: int | None, max_model_len: int, has_images: bool = False,
                    specials: tuple[int, int] = (0, 0)) -> list[int]:
    """The last k of `ids`. `specials`: the special tokens a text's tokenizer put before and after it, kept (the
    text between them is cut), as a tokenizer truncating on the left keeps them. A k over the context length is
    refused (as vLLM), and so is truncating a prompt with images (their placeholder tokens would be cut from
    their pixels)."""
    k = truncation_length(k, max_model_len)
    if k is None or len(ids) <= k:
        return ids
    if has_images:
        raise InvalidRequest(f"{PARAM} cannot cut a prompt with images (their placeholder tokens would lose their "
                             f"pixels)", param=PARAM)
    head, tail = specials
    if head + tail and k > head + tail and len(ids) >= head + tail:
        return ids[:head] + ids[head:len(ids) - tail][-(k - head - tail):] + ids[len(ids) - tail:]
    return ids[-k:]


def truncation_length(k: int | None, max_model_len: int) -> int | None:
    """The k of a request's truncate_prompt_tokens (-1: max_model_len), validated; None: no truncation."""
    check_truncation(k)
    if k is None:
        return None
    if k == -1:
        return max_model_len
    if k > max_model_len:
        raise InvalidRequest(f"{PARAM} ({k}) is greater than max_model_len ({max_model_len}); ask for a smaller "
                             f"truncation size", param=PARAM)
    return k
