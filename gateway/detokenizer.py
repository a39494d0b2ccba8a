"""Incremental detokenization with stop strings.

The engine hands us output token ids a few at a time; :class:`IncrementalDetokenizer`
turns them into text deltas suitable for streaming.

Decoding uses the prefix-offset / read-offset technique of vLLM's and TGI's
incremental detokenizers: only a small window of output ids is decoded per step,

* ``ids[prefix_offset:read_offset]`` -- tokens whose text was already emitted (context),
* ``ids[prefix_offset:]``            -- the same plus the not-yet-emitted tokens,

and the difference of the two strings is the new text.  Decoding the context along
with the new tokens keeps word-boundary effects (sentencepiece's leading-space
stripping, byte-level merges) identical to a full decode, and a window whose text
ends in U+FFFD (a multi-byte character split across tokens) is held back until a
later token completes it.  Each step therefore costs O(window), not O(length).

Decoding starts at the first *output* token (the prompt is not used as context), so
the concatenation of all deltas equals ``tokenizer.decode(output_ids)``; stop
strings likewise only ever match generated text.

``tokenizers.decoders.DecodeStream`` implements the same window in Rust, but it has
no flush (bytes of an incomplete character at the end of a request would be lost)
and it hides its offsets, so we keep the window ourselves and call the tokenizer's
Rust ``decode`` directly on it, which measures about as fast (a few microseconds
per token, flat in the output length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from gateway.stop_matcher import StopMatcher

_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizerDelta:
    """Result of one :meth:`IncrementalDetokenizer.add_tokens` call."""

    text: str  # new text to emit now (may be "")
    stop_string: str | None  # the stop string that matched (the request must finish now), else None


def _make_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """Return ``ids -> text`` equivalent to ``tokenizer.decode(ids, skip_special_tokens=...)``.

    For a fast (Rust-backed) tokenizer that does no Python-side clean-up we call the
    backend directly, skipping the transformers wrapper overhead; otherwise (slow
    tokenizers, clean-up enabled) we use ``tokenizer.decode`` itself.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
    if backend is not None and hasattr(backend, "decode") and not cleanup:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, honouring stop strings.

    Guarantees:

    * no delta ends in a broken multi-byte character (it is held back until complete);
    * without a stop match, ``"".join(deltas) + flush()`` equals
      ``tokenizer.decode(output_ids, skip_special_tokens=...)``;
    * text that might be the start of a stop string is held back until it either
      completes the stop string (then it is cut, or kept with
      ``include_stop_str_in_output``) or stops being a possible prefix;
    * the stop string that ends the output is the first one completed in the text (of
      several ending at the same character, the longest), however the text was chunked;
    * no stop string ends in text decoded while at most ``min_tokens`` output tokens had been
      added (vLLM's rule: no stop condition but max_tokens before ``min_tokens`` tokens); one
      may begin there and end later;
    * after a stop string matched, nothing more is emitted.

    ``prompt_token_ids`` is accepted for API symmetry but is not decoded: stop strings
    never match the prompt, and output decoding starts at the first output token.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self._decode = _make_decode(tokenizer, skip_special_tokens)
        self.prompt_token_ids = list(prompt_token_ids)
        if isinstance(stop, str):
            stop = [stop]
        self._matcher = StopMatcher(stop or ()) if stop else None
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens

        self._ids: list[int] = []  # output ids accepted so far
        self._prefix_offset = 0  # window start: context tokens, already emitted
        self._read_offset = 0  # first token whose text is not yet decoded
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset]), cached

        self._pending = ""  # decoded text held back (possible stop-string prefix)
        self._emitted: list[str] = []  # emitted deltas
        self._stop_string: str | None = None
        self._finished = False  # a stop matched, or flush() was called

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """All text emitted so far (nothing that is still held back)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def num_output_tokens(self) -> int:
        """Output tokens accepted.

        Includes every token of the ``add_tokens`` call in which a stop string matched;
        tokens passed in later calls are ignored.
        """
        return len(self._ids)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop_string

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Append one or more output token ids; return the text that can be emitted now."""
        if self._finished:
            return DetokenizerDelta("", self._stop_string)
        self._ids.extend(token_ids)
        return DetokenizerDelta(self._emit(self._decode_new(final=False), final=False), self._stop_string)

    def flush(self) -> str:
        """End of request: emit everything held back (incomplete characters included).

        Stop strings are still applied to the flushed text.  Idempotent.
        """
        if self._finished:
            return ""
        text = self._emit(self._decode_new(final=True), final=True)
        self._finished = True
        return text

    # ------------------------------------------------------------------ internals

    def _decode_new(self, final: bool) -> str:
        """Decode the window and return text of the tokens past ``read_offset``.

        Returns "" (and keeps the offsets) while the text would end in a broken
        character, unless ``final``.
        """
        if self._read_offset == len(self._ids):
            return ""
        full = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(full) <= len(self._prefix_text) or full.endswith(_REPLACEMENT_CHAR)):
            return ""  # nothing new yet, or a multi-byte character is still incomplete
        new = full[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return new

    def _emit(self, new: str, final: bool) -> str:
        """Add decoded text to the pending buffer; release what is safe to emit.

        Only ``new`` is matched (:class:`gateway.stop_matcher.StopMatcher` carries the state
        across calls): a step costs O(new text), whatever the stop strings. The pending text
        is at most the longest stop string plus ``new``: anything that could not start a stop
        string was emitted.
        """
        pending = self._pending + new
        hit = (self._matcher.feed(new, report=len(self._ids) > self._min_tokens)
               if self._matcher is not None else None)
        if hit is not None:
            end, stop = hit
            end += len(self._pending)              # the match ends there in `pending`
            out = pending[:end] if self._include_stop else pending[: end - len(stop)]
            self._pending = ""
            self._stop_string = stop
            self._finished = True
        else:
            keep = 0 if final or self._matcher is None else self._matcher.held
            out, self._pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
        if out:
            self._emitted.append(out)
        return out
