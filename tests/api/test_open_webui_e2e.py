"""Open WebUI's default chat on the demo model, as the browser sends it: 40 built-in tools.

It used to be a 400 context_length_exceeded (6,586 prompt tokens against a
2,048-token context); with compact tool notes and the model's real 8,192-token
context it is a 200 and an answer. Prefilling ~1,200 tokens takes a minute or
two on a 2-core CPU, so this runs with the slow set (``-m slow``).
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import REPO, LiveServer
from tests.fixtures.open_webui import OPEN_WEBUI_SYSTEM, OPEN_WEBUI_TOOLS


@pytest.mark.slow
def test_open_webui_default_chat_with_forty_tools_answers(demo_model_dir):
    from app.config.loader import load_models_file, resolve
    from app.main import build_state, create_app

    config = resolve(load_models_file(REPO / "models.yaml"))  # the demo entry as shipped
    assert config.primary.params.max_model_len == 8192
    state = build_state(config, load_vision=False)
    try:
        with LiveServer(create_app(state)) as server:
            client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
            stream = client.chat.completions.create(
                model=config.primary.name, tools=OPEN_WEBUI_TOOLS, stream=True, max_tokens=24,
                stream_options={"include_usage": True},
                messages=[{"role": "system", "content": OPEN_WEBUI_SYSTEM},
                          {"role": "user", "content": "What is the capital of France?"}])
            chunks = list(stream)
    finally:
        state.worker.stop()
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert answer.strip() or calls, "an answer (or a tool call), not an error"
    usage = chunks[-1].usage
    assert usage is not None and 1000 < usage.prompt_tokens < 2048
