"""Token ids -> what logprobs show a client: the token's text and its exact bytes.

A token's bytes are not always text on their own: byte-level BPE (GPT-2, Qwen,
Llama 3, Mistral's Tekken) can split a character across tokens, and
SentencePiece has byte tokens (``<0xE2>``). So each token's bytes are read from
its vocabulary piece, and its text is those bytes decoded (a partial character
shows as U+FFFD, the bytes stay exact), as OpenAI's ``bytes`` field intends.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from app.engine import TokenLogprob


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF = _bytes_to_unicode()


@dataclass(frozen=True)
class TokenInfo:
    """One token as logprobs show it."""

    token: str
    bytes: tuple[int, ...]
    logprob: float


@dataclass(frozen=True)
class LogprobInfo:
    """A generated token and its most likely alternatives."""

    chosen: TokenInfo
    top: tuple[TokenInfo, ...] = ()


# Per tokenizer, held weakly: an unloaded model's tokenizer is not kept alive here.
_PIECES: weakref.WeakKeyDictionary[Any, dict[int, bytes]] = weakref.WeakKeyDictionary()


def _piece_bytes(tokenizer: Any, token: int) -> bytes:
    try:
        pieces = _PIECES.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        return _read_piece(tokenizer, token)
    if token not in pieces:
        pieces[token] = _read_piece(tokenizer, token)
    return pieces[token]


def _read_piece(tokenizer: Any, token: int) -> bytes:
    piece = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(piece, str):
        return b""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte token
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    if "\u2581" not in piece and all(ch in _BYTE_OF for ch in piece):  # byte-level BPE
        return bytes(_BYTE_OF[ch] for ch in piece)
    return piece.replace("\u2581", " ").encode("utf-8")


def token_info(tokenizer: Any, token: int, logprob: float) -> TokenInfo:
    raw = _piece_bytes(tokenizer, token)
    return TokenInfo(raw.decode("utf-8", errors="replace"), tuple(raw), logprob)


def logprob_infos(tokenizer: Any, logprobs: list[TokenLogprob]) -> list[LogprobInfo]:
    """The engine's token logprobs, with texts and bytes."""
    return [LogprobInfo(token_info(tokenizer, lp.token, lp.logprob),
                        tuple(token_info(tokenizer, t, v) for t, v in lp.top)) for lp in logprobs]
