"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of recent tokens and emitting only the part past what was already
emitted; a window that ends in an incomplete UTF-8 sequence waits for the next token. Stop strings are searched
in the new text plus the tail that could start a match split across tokens; output is cut at the match (kept
if include_stop_str_in_output). While streaming, the last len(longest stop)-1 characters are held back so a
stop string is never half-emitted."""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-6:])  # a little context for tokenizers that merge spaces
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # full output text so far (after stop truncation)
        self.emitted = 0  # characters of self.text already handed to a stream
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.stopped_by: str | None = None
        # Fast tokenizers stream through the Rust DecodeStream (one call per token, no re-decoding windows).
        self._rust = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if self._rust is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=list(prompt_token_ids[-6:]), skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if one was found (generation must end)."""
        if self._stream is not None:
            new = self._stream.step(self._rust, token_id)
            if not new:
                return None
        else:
            self.ids.append(token_id)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return None  # incomplete character: wait for more tokens
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.hold)
        self.text += new
        if self.stop:
            window = self.text[start:]
            best = None
            for s in self.stop:
                i = window.find(s)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                cut = start + i + (len(s) if self.include_stop else 0)
                self.text = self.text[:cut]
                self.stopped_by = s
                return s
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted, holding back a possible stop-string prefix unless finished."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
