"""Checks on what an embeddings or rerank request hands an encoder.

Every bad input becomes an ``InvalidRequestError`` naming the field (``param``)
and the item, so the client gets a 400 that says what to fix. The shapes taken
are OpenAI's embeddings ``input``:

    "text"                    one string
    ["a", "b"]                strings
    [101, 2023, 102]          one input as token ids
    [[101, 102], [101, 7592]] inputs as token ids (strings and id lists may mix)
"""

from __future__ import annotations

from app.errors import ContextLengthError, InvalidRequestError


def input_list(raw: object, *, param: str, max_inputs: int, vocab_size: int) -> list[str | list[int]]:
    """``raw`` as a list of inputs, each a non-empty string or a list of valid token ids."""
    # A string, or a flat list of ints (token ids), is one input.
    single = isinstance(raw, str) or (isinstance(raw, (list, tuple)) and bool(raw) and all(map(_is_token, raw)))
    if single:
        items: list[object] = [list(raw) if isinstance(raw, (list, tuple)) else raw]
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        raise InvalidRequestError(
            f"{param} must be a string, a list of strings, or a list of token-id lists", param=param
        )
    _check_count(items, param, max_inputs)
    out: list[str | list[int]] = []
    for i, item in enumerate(items):
        where = param if single else f"{param}[{i}]"
        if isinstance(item, str):
            out.append(check_text(item, where))
        elif isinstance(item, (list, tuple)):
            out.append(_check_tokens(item, where, vocab_size))
        elif item is None:
            raise InvalidRequestError(f"{where} is null", param=param)
        else:
            raise InvalidRequestError(f"{where} must be a string or a list of token ids", param=param)
    return out


def check_text_list(raw: object, *, param: str, max_inputs: int) -> list[str]:
    """``raw`` as a non-empty list of non-empty strings (rerank ``documents``)."""
    if not isinstance(raw, (list, tuple)):
        raise InvalidRequestError(f"{param} must be a list of strings", param=param)
    _check_count(raw, param, max_inputs)
    for i, item in enumerate(raw):
        if not isinstance(item, str):
            what = "null" if item is None else "not a string"
            raise InvalidRequestError(f"{param}[{i}] is {what}", param=param)
        check_text(item, f"{param}[{i}]")
    return list(raw)


def check_text(value: object, where: str) -> str:
    """``value`` if it is a non-empty string."""
    param = where.split("[", 1)[0]
    if value is None:
        raise InvalidRequestError(f"{where} is null", param=param)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} must be a string", param=param)
    if not value:
        raise InvalidRequestError(f"{where} is an empty string", param=param)
    return value


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


def check_count(raw: object, *, param: str, max_inputs: int) -> None:
    """Refuse more than ``max_inputs`` items at once, whatever else is wrong with them."""
    if isinstance(raw, (list, tuple)) and len(raw) > max_inputs and not all(map(_is_token, raw)):
        _check_count(raw, param, max_inputs)


def _check_count(items: list[object] | tuple[object, ...], param: str, max_inputs: int) -> None:
    if not items:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    if len(items) > max_inputs:
        raise InvalidRequestError(
            f"{param} has {len(items)} items; at most {max_inputs} are allowed per request", param=param
        )


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_tokens(item: list[object] | tuple[object, ...], where: str, vocab_size: int) -> list[int]:
    param = where.split("[", 1)[0]
    if not item:
        raise InvalidRequestError(f"{where} is an empty list of token ids", param=param)
    for j, token in enumerate(item):
        if not _is_token(token) or not 0 <= token < vocab_size:  # type: ignore[operator]
            bad = f"{where}[{j}] = {token!r} is not a token id of this model (0 to {vocab_size - 1})"
            if _is_token(token) and token >= vocab_size:  # type: ignore[operator]
                bad += _OTHER_TOKENIZER
            raise InvalidRequestError(bad, param=param)
    return [int(t) for t in item]  # type: ignore[call-overload]


# Past the vocabulary is what another tokenizer's ids look like: LangChain's OpenAIEmbeddings
# tokenizes every input with tiktoken's cl100k_base (ids up to 100k) before sending it.
_OTHER_TOKENIZER = (
    ": the client sent another tokenizer's ids (LangChain's OpenAIEmbeddings sends tiktoken cl100k_base ids "
    "by default). Send the text instead: OpenAIEmbeddings(..., check_embedding_ctx_length=False) in LangChain; "
    "input as strings for any client."
)
