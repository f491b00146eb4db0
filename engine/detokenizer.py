"""Incremental detokenizer: token ids → well-formed UTF-8 text deltas.

Every token is mapped once, at load time, to the exact bytes it stands for, so
decoding a stream is a byte concatenation followed by an incremental UTF-8
decoder that holds back incomplete characters and turns invalid bytes into
U+FFFD. The deltas therefore join to exactly what a one-shot decode gives.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from engine import harmony

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted (char → byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenBytes:
    """The byte string of every token id, as `tokenizer.decode(skip_special_tokens=True)` joins them, but
    for a harmony model's syntax tokens (engine/harmony.py), whose text shows: they structure its output."""

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        # Each token's text where its bytes are whole UTF-8 characters on their own, else None: the
        # detokenizer's fast path for a token that starts on a character boundary.
        self.texts: list[str | None] = [_whole_text(b) for b in table]

    @classmethod
    def from_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> TokenBytes:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        kinds = _decoder_kinds(decoder)
        vocab_size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        pieces = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
        added = tokenizer.added_tokens_decoder
        special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        special -= set((harmony.syntax_token_ids(tokenizer) or {}).values())
        alphabet = _byte_level_alphabet()
        table: list[bytes] = []
        for token_id, piece in enumerate(pieces):
            if piece is None or token_id in special:
                table.append(b"")
            elif token_id in added:
                table.append(added[token_id].content.encode())
            elif "ByteLevel" in kinds:
                table.append(bytes(alphabet[c] for c in piece if c in alphabet))
            elif (match := _BYTE_FALLBACK.match(piece)) and "ByteFallback" in kinds:
                table.append(bytes([int(match.group(1), 16)]))
            elif "Metaspace" in kinds or "Replace" in kinds:
                table.append(piece.replace("▁", " ").encode())
            else:
                table.append(tokenizer.decode([token_id]).encode())
        return cls(table)

    def __len__(self) -> int:
        return len(self._table)

    def join(self, token_ids: Sequence[int]) -> bytes:
        table = self._table
        return b"".join(table[t] if 0 <= t < len(table) else b"" for t in token_ids)


def _whole_text(token: bytes) -> str | None:
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _decoder_kinds(decoder: dict) -> set[str]:
    kinds = {decoder.get("type", "")}
    for child in decoder.get("decoders", []) or []:
        kinds |= _decoder_kinds(child)
    return kinds


class IncrementalDetokenizer:
    """Per-request decoder: feed token ids, get the text they complete."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._texts = token_bytes.texts
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Whether the UTF-8 decoder holds the start of an unfinished character.
        self._holding = False

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text completed by these tokens; an unfinished multi-byte character is held back."""
        if len(token_ids) == 1 and not self._holding:
            # One token, nothing held: most steps of a stream. Its text, when its bytes are whole
            # characters, is what the decoder would return, without the join and the decoder's call.
            token_id = token_ids[0]
            if 0 <= token_id < len(self._texts) and (text := self._texts[token_id]) is not None:
                return text
        text = self._utf8.decode(self._token_bytes.join(token_ids))
        self._holding = bool(self._utf8.getstate()[0])
        return text

    def flush(self) -> str:
        """Release what is held; a character that never completed becomes U+FFFD."""
        self._holding = False
        return self._utf8.decode(b"", final=True)


class StopMatcher:
    """Cuts text at the first stop string, holding back any tail that could still grow into one.

    Released text therefore never contains a stop string or the start of one that later
    completes; held text is released once the next delta rules the match out.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to release, whether a stop string was found); after a match, drop the rest."""
        if not self._stops:
            return text, False
        buffer = self._held + text
        # The first stop string to complete wins (the longest if several end together), so
        # the cut is the same however the text was split into deltas.
        matches = [(i + len(stop), -len(stop), i) for stop in self._stops if (i := buffer.find(stop)) >= 0]
        if matches:
            self._held = ""
            return buffer[: min(matches)[2]], True
        hold = self._longest_partial_match(buffer)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """Release what is held: the stream ended for another reason, so it can no longer match."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_match(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of some stop string."""
        for length in range(min(len(buffer), max(map(len, self._stops)) - 1), 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
