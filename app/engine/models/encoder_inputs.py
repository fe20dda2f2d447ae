"""What an embeddings or rerank request hands an encoder, typed, and the checks that need the model.

An encoder gets ``EncoderInputs``: texts and token-id tuples, in order. They are
built, and their shape checked, where the request is built
(``app/pipeline/request.py``: ``EmbedRequest.of``, ``RerankRequest.of``), from
OpenAI's embeddings ``input``:

    "text"                    one string
    ["a", "b"]                strings
    [101, 2023, 102]          one input as token ids
    [[101, 102], [101, 7592]] inputs as token ids (strings and id lists may mix)

so no raw JSON reaches the engine. What only the model can judge is checked
here: how many inputs it takes at once (``max_inputs``), whether each token id
is in its vocabulary, and how long each input is (``over_length``). Every bad
input becomes an ``InvalidRequestError`` (or ``ContextLengthError``) naming the
field (``param``) and the item, so the client gets a 400 that says what to fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.errors import ContextLengthError, InvalidRequestError

# Token ids a client tokenized itself (each an int; whether it is in the vocabulary is the model's to say).
TokenIds = tuple[int, ...]
# One input to encode: a text, or token ids.
EncoderInput = str | TokenIds


@dataclass(frozen=True)
class EncoderInputs:
    """One request's inputs, in order; ``param`` names them in errors (``input``,
    ``documents``, ``query``)."""

    items: tuple[EncoderInput, ...]
    param: str = "input"
    # The client sent one input alone (a string, or one flat list of ids): an error names
    # ``input`` rather than ``input[0]``.
    bare: bool = False

    def where(self, i: int) -> str:
        """How the client's request names input ``i``."""
        return self.param if self.bare else f"{self.param}[{i}]"


def check_count(inputs: EncoderInputs, *, max_inputs: int) -> None:
    """Refuse more than ``max_inputs`` inputs at once, before they wait or are tokenized."""
    if len(inputs.items) > max_inputs:
        raise InvalidRequestError(
            f"{inputs.param} has {len(inputs.items)} items; at most {max_inputs} are allowed per request",
            param=inputs.param,
        )


def check_token_ids(ids: TokenIds, where: str, vocab_size: int) -> list[int]:
    """``ids`` if every one is a token id of this model's vocabulary."""
    param = where.split("[", 1)[0]
    for j, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            bad = f"{where}[{j}] = {token!r} is not a token id of this model (0 to {vocab_size - 1})"
            raise InvalidRequestError(bad + _OTHER_TOKENIZER if token >= vocab_size else bad, param=param)
    return list(ids)


def over_length(model: str, where: str, tokens: int, limit: int, *, pair: bool = False,
                at_least: bool = False) -> ContextLengthError:
    """The error for an input longer than the model takes (raise it); ``at_least`` when only
    a prefix of it was tokenized."""
    what = "query and document together have" if pair else "has"
    count = f"at least {tokens}" if at_least else str(tokens)
    return ContextLengthError(
        f"{where}: {what} {count} tokens; model {model!r} takes at most {limit} per input. "
        'Shorten it, or send "truncate": true to cut it to the limit.',
        param=where.split("[", 1)[0],
    )


# Past the vocabulary is what another tokenizer's ids look like: LangChain's OpenAIEmbeddings
# tokenizes every input with tiktoken's cl100k_base (ids up to 100k) before sending it.
_OTHER_TOKENIZER = (
    ": the client sent another tokenizer's ids (LangChain's OpenAIEmbeddings sends tiktoken cl100k_base ids "
    "by default). Send the text instead: OpenAIEmbeddings(..., check_embedding_ctx_length=False) in LangChain; "
    "input as strings for any client."
)
