"""Fuzzing with schemathesis against the app's own OpenAPI schema: no input may give a 5xx.

Valid and invalid bodies, headers and paths for every operation in
``/docs/openapi.json``, sent to a real server on the tiny model (a 64-token
context keeps every generation short). Kept out of the default run:

    scripts/test.sh -m fuzz            # TANDEM_FUZZ_EXAMPLES=n per operation (default 60)
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from tests.api.serving import serving, tiny_yaml  # noqa: E402

pytestmark = pytest.mark.fuzz
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "60"))
# A random model name is a 404 and random messages mostly break rules the schema cannot state
# (a tool message needs tool_call_id); so most cases name the served model, and many carry a
# plain message, for sampling fields, stops, tools and streaming to reach generation.
# (Hypothesis favours the first entry.)
REWRITES = [{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}, {"model": "tiny"}, {}]


@pytest.fixture(scope="session")
def fuzzed_server(tmp_path_factory, tiny_model_dir):
    yaml = tiny_yaml(tiny_model_dir, {"openapi_schema": True}, params={"max_model_len": 64, "max_tokens": 4})
    with serving(tmp_path_factory.mktemp("fuzz"), yaml) as served:
        yield served


def operation_fuzzer(operation, mode: str, statuses: Counter[tuple[str, int]]):
    """The hypothesis test for one operation, counting each response's status into ``statuses``."""

    @given(case=operation.as_strategy(GenerationMode(mode)), rewrite=st.sampled_from(REWRITES))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def fuzz(case, rewrite):
        if isinstance(case.body, dict):
            case.body.update({k: v for k, v in rewrite.items() if k in case.body})
        response = case.call(timeout=60)
        statuses[(operation.label, response.status_code)] += 1
        case.validate_response(response, checks=[not_a_server_error])

    return fuzz


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_input_gives_a_server_error(fuzzed_server, mode):
    """Each operation gets ``EXAMPLES`` cases: schema-valid ones, or ones that break the schema."""
    # Driven through hypothesis directly: schemathesis' pytest loader does not run on pytest 9.
    api = schemathesis.openapi.from_url(fuzzed_server.base_url + "/docs/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    labels = {op.label for op in operations}
    # Every route a client can call, AG-UI and Anthropic's Messages included.
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/agui", "GET /v1/models",
            "POST /v1/messages", "POST /v1/messages/count_tokens", "GET /health", "GET /metrics"} <= labels, labels
    statuses: Counter[tuple[str, int]] = Counter()
    for operation in operations:
        fuzz = operation_fuzzer(operation, mode, statuses)
        try:
            fuzz()
        except Unsatisfiable:  # nothing in this operation can break the schema (GET /health)
            assert mode == "negative"
        assert fuzzed_server.state.worker.alive, operation.label
    print(f"\n{mode}: {sum(statuses.values())} requests; by operation and status: {dict(sorted(statuses.items()))}")
    assert fuzzed_server.get("/health").json()["status"] == "ok"
