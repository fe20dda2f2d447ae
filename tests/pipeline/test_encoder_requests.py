"""Embeddings and rerank requests are typed where they are built.

``EmbedRequest.of`` / ``RerankRequest.of`` read the client's JSON into texts and
token ids (``EncoderInputs``) and refuse a bad shape with a 400 naming the item,
before any model is looked up; the encoder gets only typed inputs and checks what
needs the model (the vocabulary, how many inputs it takes, their length).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_type_hints

import pytest

from app.engine.models.encoder import Encoder
from app.engine.models.encoder_inputs import EncoderInputs
from app.errors import InvalidRequestError
from app.pipeline.request import EmbedRequest, RerankRequest


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ([], "input must not be empty"),
        (None, "input must be a string, a list of strings, or a list of token-id lists"),
        ({"input": "x"}, "input must be a string, a list of strings"),
        (3, "input must be a string"),
        ("", "input is an empty string"),
        (["ok", None], "input[1] is null"),
        (["ok", ""], "input[1] is an empty string"),
        ([[]], "input[0] is an empty list of token ids"),
        ([[101, 1.5]], "input[0][1] = 1.5 is not a token id"),
        ([[101, True]], "input[0][1] = True is not a token id"),
        ([True, False], "input[0] must be a string or a list of token ids"),
        ([{"text": "x"}], "input[0] must be a string or a list of token ids"),
        ([101, "x"], "input[0] must be a string or a list of token ids"),
    ],
)
def test_a_bad_input_shape_is_a_400_where_the_request_is_built(raw, fragment):
    with pytest.raises(InvalidRequestError) as err:
        EmbedRequest.of("no-such-model", raw)
    assert err.value.status_code == 400 and err.value.param == "input" and fragment in err.value.message


def test_inputs_are_typed_texts_and_token_ids():
    assert EmbedRequest.of("m", "hi").input == EncoderInputs(("hi",), "input", bare=True)
    assert EmbedRequest.of("m", [101, 102]).input == EncoderInputs(((101, 102),), "input", bare=True)
    mixed = EmbedRequest.of("m", ["a", [101, 102]], truncate=True, dimensions=8)
    assert mixed.input == EncoderInputs(("a", (101, 102)), "input")
    assert (mixed.truncate, mixed.dimensions) == (True, 8)
    assert mixed.input.where(1) == "input[1]" and EmbedRequest.of("m", [7]).input.where(0) == "input"


def test_what_needs_the_model_is_left_to_it():
    """Ids beyond any vocabulary, and more inputs than a model takes, are the encoder's to refuse."""
    assert EmbedRequest.of("m", [[101, 99999999], [-1]]).input.items == ((101, 99999999), (-1,))
    assert len(EmbedRequest.of("m", ["x"] * 5000).input.items) == 5000


@pytest.mark.parametrize(
    ("query", "documents", "param", "fragment"),
    [
        ("q", [], "documents", "documents must not be empty"),
        ("q", ["a", None], "documents", "documents[1] is null"),
        ("q", ["a", 3], "documents", "documents[1] is not a string"),
        ("q", ["a", ""], "documents", "documents[1] is an empty string"),
        ("q", "just one string", "documents", "documents must be a list of strings"),
        ("", ["a"], "query", "query is an empty string"),
        (None, ["a"], "query", "query is null"),
        ([1], ["a"], "query", "query must be a string"),
    ],
)
def test_a_bad_rerank_request_is_a_400_where_it_is_built(query, documents, param, fragment):
    with pytest.raises(InvalidRequestError) as err:
        RerankRequest.of("no-such-model", query, documents)
    assert err.value.param == param and fragment in err.value.message


def test_rerank_requests_are_typed():
    req = RerankRequest.of("m", "cats?", ["a", "b"], truncate=True)
    assert (req.query, req.documents, req.truncate) == ("cats?", ("a", "b"), True)


def test_the_engine_takes_only_typed_inputs():
    assert get_type_hints(EmbedRequest)["input"] is EncoderInputs
    rerank = get_type_hints(RerankRequest)
    assert rerank["query"] is str and rerank["documents"] == tuple[str, ...]
    for method in (Encoder.tokenize, Encoder.check_size, Encoder.prepare_embed, Encoder.embed, Encoder.embed_steps):
        assert get_type_hints(method)["inputs"] is EncoderInputs, method.__name__
    for method in (Encoder.prepare_rerank, Encoder.rerank, Encoder.rerank_steps):
        hints = get_type_hints(method)
        assert hints["query"] is str and hints["documents"] == Sequence[str], method.__name__
