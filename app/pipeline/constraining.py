"""A request's output constraint: ``response_format`` and ``tool_choice`` as a grammar.

    ChatRequest.output / tool_choice / tools          (every wire format maps onto these)
        constraint_spec()   -> JsonSchema | JsonObject | ToolCalls | None
        reasoning_for()     -> Reasoning | None      (the model may think first, freely)
        compile_constraint() -> Grammar              (app.engine.constrain.grammar; a 400 if it cannot be)

What each request asks for:

    tool_choice required (Anthropic any)                   one or more calls (at most MAX_PARALLEL_CALLS),
                                                           in the model's own call syntax; one if not parallel
    tool_choice named (Anthropic tool)                     one call, unless parallel calls are asked for
    tool_choice auto, tools offered, a response_format     a call, or an answer in the format
    tool_choice auto/none, a response_format               an answer in the format
    otherwise                                              nothing: free text, no cost

The call syntax is the one the model was told to use: the family's own markers
when its chat template renders the tools, else the bare JSON object the tool
note asks for (``prompting.tool_note``), which every parser family reads.
"""

from __future__ import annotations

from typing import Any

from app.engine import Constraint, Grammar, JsonObject, JsonSchema, Reasoning, ToolCalls, compiler_for
from app.engine import Tool as GrammarTool
from app.errors import InvalidRequestError
from app.families.syntax import HarmonyCalls, RecipientCalls
from app.pipeline.prompting import ModelProfile
from app.pipeline.request import ChatRequest, OutputFormat, Tool

# Keys whose values are data, not schemas: never rewritten.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "x-guidance"})
# Keys whose values map names to schemas.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object schema that lists
    ``properties`` and says nothing of others. JSON Schema allows any extra key there; a
    small model then invents keys until max_tokens. xgrammar's strict mode and llama.cpp's
    converter read a schema the same way; a schema that wants extra keys says so."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in _DATA_KEYS else closed_objects(value)
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                           "unevaluatedProperties"} & schema.keys():
        out["additionalProperties"] = False
    return out


def _answer(output: OutputFormat) -> JsonSchema | JsonObject | None:
    if output.kind == "json_schema" and output.schema is not None:
        return JsonSchema(closed_objects(output.schema), strict=output.strict)
    if output.kind in ("json_schema", "json_object"):
        return JsonObject()
    return None


def _tool(t: Tool) -> GrammarTool:
    return GrammarTool(t.name, closed_objects(t.parameters), strict=t.strict)


def constraint_spec(profile: ModelProfile, req: ChatRequest, offered: tuple[Tool, ...]) -> Constraint | None:
    """What the output must be, or None for free text. ``offered``: the tools the model
    is shown (``prompting.offered_tools``: just the named one for a named choice)."""
    answer = _answer(req.output)
    mode = req.tool_choice.mode
    if offered and mode in ("required", "named"):
        return ToolCalls(tuple(map(_tool, offered)), profile.call_syntax, parallel=forced_parallel(req))
    if offered and answer is not None:
        return ToolCalls(tuple(map(_tool, offered)), profile.call_syntax,
                           parallel=req.parallel_tool_calls is not False, answer=answer)
    return answer


def forced_parallel(req: ChatRequest) -> bool:
    """Whether a forced answer may hold several calls (at most ``MAX_PARALLEL_CALLS``): a named
    choice is one call unless the client asked for parallel calls in so many words; ``required``
    (Anthropic's ``any``) may be several unless the client turned them off. A small model that
    repeats a call then stops where the grammar does, not at max_tokens with a cut list."""
    if req.tool_choice.mode == "named":
        return req.parallel_tool_calls is True
    return req.parallel_tool_calls is not False


def reasoning_for(profile: ModelProfile, prompt_text: str, parse_reasoning: bool) -> Reasoning | None:
    """The free reasoning block allowed before the constrained output: when the model's
    reasoning is read at all (thinking on, or a template with no switch), and the prompt
    opened the block or the model opens it with its one reasoning token."""
    if not parse_reasoning:
        return None
    opener, closer = profile.reasoning_markers
    started = profile.opens_reasoning(prompt_text)
    harmony = isinstance(profile.call_syntax, (HarmonyCalls, RecipientCalls))  # a message of its own
    if not started and not profile.reasoning_opener_is_token and not harmony:
        # A text opener ("<think>" in several tokens) would let a model that does not
        # reason wander into a block through "<" and spend its tokens there.
        return None
    return Reasoning(opener, closer, started=started)


def compile_constraint(profile: ModelProfile, spec: Constraint | None, reasoning: Reasoning | None,
                       param: str = "response_format") -> Grammar | None:
    """The compiled grammar (cached per tokenizer); ``InvalidRequestError`` when the schema
    or a tool's parameters cannot be compiled. Runs off the event loop: the first one for a
    tokenizer builds llguidance's view of its vocabulary (about half a second)."""
    if spec is None:
        return None
    try:
        return compiler_for(profile.tokenizer).compile(spec, reasoning)
    except InvalidRequestError as exc:
        if exc.param == "response_format" and param != exc.param:  # the client's own name for it
            raise InvalidRequestError(exc.message, param=param, code=exc.code) from exc
        raise


def check_constraint(profile: ModelProfile, req: ChatRequest, offered: tuple[Tool, ...]) -> None:
    """Compile the request's constraint alone, to refuse a bad schema before slow work
    (captioning images) rather than after it."""
    compile_constraint(profile, constraint_spec(profile, req, offered), None, req.output.param)

