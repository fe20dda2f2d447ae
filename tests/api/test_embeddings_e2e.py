"""/v1/embeddings and /v1/rerank end to end with the real all-MiniLM-L6-v2, next to a chat model.

The openai SDK (which asks for base64 by default), plain float JSON, token-id
input, bad inputs, rerank ordering, and the exact request Open WebUI's RAG sends
when Tandem is its embedding engine (RAG_EMBEDDING_ENGINE=openai).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import yaml
from openai import OpenAI

from tests.api.serving import assert_openai_error, serving
from tests.fixtures.open_webui import embeddings_request, queries_from_reply, query_generation_request

KEY = "sk-rag"
SENTENCES = ["A cat sits on the mat.", "A kitten is sleeping on a rug.", "The stock market closed higher today."]


@pytest.fixture(scope="module")
def srv(tmp_path_factory, minilm_dir):
    models = [
        {"name": "demo", "builtin": "smollm2-135m-instruct", "params": {"mem": 64, "max_model_len": 2048}},
        {"name": "all-minilm-l6-v2", "role": "embedding", "builtin": "all-minilm-l6-v2", "params": {"max_inputs": 64}},
        # The same model with truncation off: long inputs are 400s unless a request asks.
        {"name": "strict-minilm", "role": "embedding", "builtin": "all-minilm-l6-v2", "params": {"truncate": False}},
    ]
    text = yaml.safe_dump({"default_model": "demo", "server": {"api_key": KEY, "shutdown_grace_s": 1},
                           "models": models})
    with serving(tmp_path_factory.mktemp("embeddings"), text) as served:
        yield served


def client(srv) -> OpenAI:
    return OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(srv, path: str, body: dict):
    return srv.post(path, body, headers={"authorization": f"Bearer {KEY}"})


def cos(a, b) -> float:
    return float(np.dot(a, b))


def test_the_openai_sdk_gets_unit_vectors_and_usage(srv):
    with client(srv) as c:
        r = c.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES)  # the SDK sends base64
    vectors = [np.array(d.embedding) for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and len(vectors[0]) == 384
    assert all(abs(np.linalg.norm(v) - 1) < 1e-4 for v in vectors)
    assert r.usage.prompt_tokens > 3 * 5 and r.usage.total_tokens == r.usage.prompt_tokens
    cat, kitten, market = vectors
    assert cos(cat, kitten) > cos(cat, market) + 0.2


def test_base64_equals_float_and_batched_equals_single(srv):
    floats = post(srv, "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": SENTENCES}).json()
    with client(srv) as c:
        b64 = c.embeddings.create(model="all-minilm-l6-v2", input=SENTENCES, encoding_format="base64")
        singles = [c.embeddings.create(model="all-minilm-l6-v2", input=s, encoding_format="float") for s in SENTENCES]
    for i, d in enumerate(floats["data"]):
        # Asked for explicitly, the SDK hands base64 over as it came: little-endian float32.
        decoded = np.frombuffer(base64.b64decode(b64.data[i].embedding), dtype="<f4")
        assert np.array_equal(np.array(d["embedding"], dtype=np.float32), decoded)
        assert np.allclose(d["embedding"], singles[i].data[0].embedding, atol=1e-5)


def test_token_ids_equal_the_text(srv):
    from tokenizers import Tokenizer

    from app.engine.models.builtin_models import ensure_minilm

    tokenizer = Tokenizer.from_file(str(ensure_minilm(progress=False) / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128; ids are used exactly as sent
    ids = tokenizer.encode(SENTENCES[0]).ids
    by_ids = post(srv, "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": [ids]}).json()["data"][0]
    by_text = post(srv, "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": SENTENCES[0]}).json()["data"][0]
    assert np.allclose(by_ids["embedding"], by_text["embedding"], atol=1e-5)


@pytest.mark.parametrize("name, body, code, param, names", [
    ("empty string", {"input": ""}, None, "input", "input"),
    ("empty list", {"input": []}, None, "input", "input"),
    ("a null item", {"input": ["ok", None]}, None, "input", "input[1]"),
    ("too many inputs", {"input": ["x"] * 65}, None, "input", "64"),
    ("over the model's length, truncation off", {"input": "word " * 600, "truncate": False},
     "context_length_exceeded", "input", "256"),
    ("a token id outside the vocabulary", {"input": [[101, 99999999]]}, None, "input", "input[0][1]"),
    ("tiktoken ids, as LangChain sends", {"input": [[9906, 1917, 100256]]}, None, "input", "another tokenizer's ids"),
    ("other dimensions", {"input": "hi", "dimensions": 128}, None, "dimensions", "384"),
], ids=lambda v: v if isinstance(v, str) and " " in v else "")
def test_bad_inputs_are_400s_naming_the_item(srv, name, body, code, param, names):
    err = assert_openai_error(post(srv, "/v1/embeddings", {"model": "all-minilm-l6-v2", **body}), 400, code)
    assert err["param"] == param and names in err["message"], err


@pytest.fixture(scope="module")
def wordpiece(minilm_dir):
    """MiniLM's own tokenizer, whole (no truncation): how long an input really is."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_truncation()
    return tok


def cut_counters(srv, model: str = "all-minilm-l6-v2") -> tuple[float, float]:
    text = srv.get("/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    values = []
    for name in ("tandem_encoder_truncated_inputs_total", "tandem_encoder_truncated_tokens_total"):
        line = next(x for x in text.splitlines() if x.startswith(f'{name}{{model="{model}"}}'))
        values.append(float(line.rsplit(" ", 1)[1]))
    return values[0], values[1]


def test_long_inputs_are_cut_by_default_and_counted(srv, wordpiece):
    long = "word " * 600
    before = cut_counters(srv)
    r = post(srv, "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": [long, "short"]})
    assert r.status_code == 200, r.text
    cut = len(wordpiece.encode(long).ids) - 256
    assert r.json()["usage"] == {"prompt_tokens": 256 + 3, "total_tokens": 256 + 3, "truncated_inputs": 1,
                                 "truncated_tokens": cut}
    assert cut_counters(srv) == (before[0] + 1, before[1] + cut)
    # Asked for: the same vector.
    asked = post(srv, "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": [long, "short"], "truncate": True})
    assert asked.json()["data"] == r.json()["data"]
    # Nothing cut: OpenAI's usage, nothing added.
    assert set(post(srv, "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": "short"}).json()["usage"]) == {
        "prompt_tokens", "total_tokens"}


def test_truncation_off_in_models_yaml_keeps_the_400(srv):
    long = "word " * 300
    err = assert_openai_error(post(srv, "/v1/embeddings", {"model": "strict-minilm", "input": long}), 400,
                              "context_length_exceeded")
    assert "302 tokens" in err["message"] and '"truncate": true' in err["message"]
    r = post(srv, "/v1/embeddings", {"model": "strict-minilm", "input": long, "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["truncated_tokens"] == 302 - 256
    documents = ["cats", long]
    assert_openai_error(post(srv, "/v1/rerank", {"model": "strict-minilm", "query": "cats", "documents": documents}),
                        400, "context_length_exceeded")
    ranked = post(srv, "/v1/rerank", {"model": "all-minilm-l6-v2", "query": "cats", "documents": documents})
    assert ranked.status_code == 200 and ranked.json()["usage"]["truncated_inputs"] == 1


def open_webui_reply(wordpiece, tokens: int) -> str:
    """A retrieval-query reply written as prose, not JSON (what the demo model wrote), of
    ``tokens`` MiniLM tokens with [CLS] and [SEP]."""
    words = ("The user wants to know what the attached file says about the project plan and its dates, so "
             "relevant searches would cover the plan, the schedule, the milestones and the people").split()
    text, n = "", 0
    while len(wordpiece.encode(text).ids) < tokens:
        text = f"{text} {words[n % len(words)]}".strip()
        n += 1
    assert len(wordpiece.encode(text).ids) == tokens
    return text


def test_open_webui_document_chat_embeds_a_long_query(srv, wordpiece):
    """Open WebUI's document chat with its default settings, as its own HTTP calls: the chat
    model's query-generation reply (prose, 258 MiniLM tokens, as the demo model wrote it) is
    read as Open WebUI reads it (no JSON object: the whole reply is the query) and embedded.
    It used to be a 400 Open WebUI cannot avoid (it has no "truncate"), and the answer came
    back with no sources; Open WebUI itself is not installed here (its wheel pulls torch,
    sentence-transformers and chromadb)."""
    import httpx

    queries = queries_from_reply(open_webui_reply(wordpiece, 258))
    assert len(queries) == 1
    body, headers = embeddings_request("all-minilm-l6-v2", queries, KEY)
    r = httpx.post(srv.base_url + "/v1/embeddings", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == 384
    assert r.json()["usage"]["truncated_tokens"] == 2


@pytest.mark.slow
def test_open_webui_query_generation_then_embedding(srv):
    """The whole flow on the demo model: Open WebUI's query-generation request as it sends
    it (no max_tokens), its reading of the reply, then the embedding call: every query,
    however long the model's reply, gets a vector."""
    import httpx

    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=900, headers={"authorization": f"Bearer {KEY}"},
                   json=query_generation_request("demo", "What does the attached plan say about the launch date?"))
    assert r.status_code == 200, r.text
    queries = queries_from_reply(r.json()["choices"][0]["message"]["content"]) or ["launch date"]
    body, headers = embeddings_request("all-minilm-l6-v2", queries, KEY)
    embedded = httpx.post(srv.base_url + "/v1/embeddings", json=body, headers=headers, timeout=120)
    assert embedded.status_code == 200, embedded.text
    assert len(embedded.json()["data"]) == len(queries)


def test_models_serve_their_own_apis(srv):
    assert_openai_error(post(srv, "/v1/embeddings", {"model": "demo", "input": "hi"}), 400, "wrong_model_type")
    r = post(srv, "/v1/chat/completions", {"model": "all-minilm-l6-v2", "messages": [{"role": "user", "content": "x"}]})
    assert_openai_error(r, 400, "wrong_model_type")
    assert_openai_error(post(srv, "/v1/embeddings", {"model": "nope", "input": "hi"}), 404, "model_not_found")
    listed = {m["id"]: m for m in client(srv).models.list().model_dump()["data"]}
    assert listed["all-minilm-l6-v2"]["role"] == "embedding"


def test_rerank_orders_documents_by_relevance(srv):
    docs = ["The stock market closed higher today.", "Cats love to eat fish and chicken.", "It rained in Paris."]
    r = post(srv, "/v1/rerank", {"model": "all-minilm-l6-v2", "query": "What food do cats like?", "documents": docs})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results][0] == 1
    assert [x["relevance_score"] for x in results] == sorted((x["relevance_score"] for x in results), reverse=True)
    assert results[0]["document"] == {"text": docs[1]}
    top = post(srv, "/v1/rerank", {"model": "all-minilm-l6-v2", "query": "cats", "documents": docs, "top_n": 1,
                                   "return_documents": False}).json()["results"]
    assert len(top) == 1 and "document" not in top[0]
    objects = [{"text": d} for d in docs]  # Jina's document objects
    assert post(srv, "/v1/rerank", {"model": "all-minilm-l6-v2", "query": "cats", "documents": objects}).json()[
        "results"][0]["index"] == 1


def test_open_webui_rag_request(srv):
    """Exactly what Open WebUI sends with RAG_EMBEDDING_ENGINE=openai (its
    generate_openai_batch_embeddings), user-info headers included."""
    import httpx

    r = httpx.post(srv.base_url + "/v1/embeddings", timeout=120, json={"input": SENTENCES, "model": "all-minilm-l6-v2"},
                   headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                            "X-OpenWebUI-User-Name": "Ada", "X-OpenWebUI-User-Id": "u1",
                            "X-OpenWebUI-User-Email": "ada@example.com", "X-OpenWebUI-User-Role": "user"})
    assert r.status_code == 200, r.text
    data = r.json()
    assert "data" in data and [len(e["embedding"]) for e in data["data"]] == [384, 384, 384]
