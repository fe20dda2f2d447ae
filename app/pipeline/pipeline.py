"""The one request path every wire format takes.

    app/api/<format>.py     parse the body into a ChatRequest / TextRequest
      Pipeline.prepare_*    check model and limits, vision, chat template, tokenize
      Pipeline.steps        generate on the engine, parse reasoning and tool calls
      Pipeline.complete     the same steps, folded (non-streaming)
    app/api/<format>.py     render Steps / the Completion in its own format

Nothing here knows a wire format, Litestar or pydantic request models; errors
are raised from ``app.errors`` and each format's edge renders them.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import anyio

from app.config.schema import ChatParams, ModelCapabilities, ServerSettings
from app.engine import (
    CacheBreakpoint,
    Embeddings,
    EncoderInputs,
    Engine,
    GenerationRecord,
    GenerationRequest,
    Grammar,
    Lease,
    Prompt,
    Ranking,
    Reasoning,
    ReasoningBlock,
    Registry,
    SamplingParams,
    SpeculationRequest,
    TokenPrompt,
    completion_room,
)
from app.errors import ContextLengthError, InvalidRequestError, VisionNotSupportedError
from app.families import BARE_JSON, CallSyntax
from app.parsers import ReasoningDelta, make_parser
from app.pipeline.breakpoints import breakpoints
from app.pipeline.constraining import check_constraint, compile_constraint, constraint_spec, reasoning_for
from app.pipeline.decisions import reading
from app.pipeline.decisions.request import Decision, DecisionRequest
from app.pipeline.logprobs import logprob_infos
from app.pipeline.predicted import prediction_usage
from app.pipeline.prompting import (
    ModelProfile,
    encode,
    gather_system,
    make_profile,
    offered_tools,
    render,
    template_messages,
    tool_note,
)
from app.pipeline.request import (
    ChatRequest,
    EmbedRequest,
    Message,
    Options,
    Priority,
    RerankRequest,
    Speculation,
    TextRequest,
    Tool,
    merge_turns,
)
from app.pipeline.results import Completion, Step, Usage
from app.pipeline.tokenizing import check_within, encode_within
from app.request_context import CLIENT, REQUEST_ID, note_model

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger("tandem.api")

# Open WebUI's title, tags and follow-up prompts start so; they run as background work.
BACKGROUND_TASK_PREFIX = "### Task:"
# Sampling values this close to their limit are that limit: 1e-39 is greedy, not overflow.
SAMPLING_EPSILON = 1e-5


@dataclass
class VisionState:
    """How images reach a chat model, as /health and /v1/models report it."""

    mode: str  # the model's vision_mode
    model: str | None = None
    available: bool = False
    reason: str | None = None
    proxy: Any = None  # app.vision.proxy.VisionProxy when mode is proxy
    # Native mode: a request's messages -> their images, checked and decoded at the model's
    # size, in order (app.vision.wiring.native_reader).
    images: Callable[[tuple[Message, ...]], Awaitable[list[Image]]] | None = None


@dataclass
class ServedModel:
    """A loaded chat model the pipeline can send requests to."""

    profile: ModelProfile
    engine: Engine
    vision: VisionState


@dataclass
class Prepared:
    """A request ready for the engine: its tokens, and how to read what comes back."""

    # The served model's name (ModelProfile.name).
    model: str
    gen: GenerationRequest
    prompt_text: str
    # The parser family; None for plain text (completions), which is not parsed.
    parser: str | None = None
    # Reasoning markers are read (the model may reason even when it was asked not to:
    # a template with no thinking switch cannot turn it off).
    parse_reasoning: bool = False
    # Reasoning goes out to the client (otherwise it is dropped, never left in content).
    emit_reasoning: bool = False
    starts_in_reasoning: bool = False
    tools_offered: bool = False
    # Captions, warnings and (on request) the prompt: Tandem's response extensions.
    extras: dict[str, Any] = field(default_factory=dict)
    # Keeps the model loaded from preparation to the end of generation.
    lease: Lease[Engine] | None = None
    # Choices generated from the prompt.
    n: int = 1
    # The offered tools' parameter schemas by name: what arguments written as text mean.
    tools: dict[str, Any] = field(default_factory=dict)
    # A call marker the prompt ended with (Functionary's >>>), read first as the model's.
    primer: str = ""

    @property
    def warnings(self) -> list[str]:
        """What the client should know about how it was served (images the model could not see):
        every format sends them in a header, and in its body where it has room."""
        return list(self.extras.get("warnings", ()))


@dataclass(frozen=True)
class ChatConfig:
    """What the pipeline knows of a chat entry before it loads: its models.yaml view."""

    params: ChatParams
    caps: ModelCapabilities


class Pipeline:
    """Check, see, render, tokenize, generate, parse: the shared steps of every format."""

    def __init__(self, registry: Registry, server: ServerSettings, chats: dict[str, ChatConfig],
                 vision: dict[str, VisionState]) -> None:
        self.registry = registry
        self.server = server
        self._chats = chats
        self._vision = vision
        self._profiles: dict[str, tuple[Engine, ModelProfile]] = {}

    async def served(self, name: str, param: str = "model") -> tuple[ServedModel, Lease[Engine]]:
        """The chat model ``name`` (or an alias), loaded, with a lease the caller releases;
        404 for an unknown model, 400 for one that is not a chat model."""
        lease = await self.registry.acquire_chat(name, param=param)
        note_model(lease.name)
        try:
            return self._served(lease.name, lease.handle), lease
        except BaseException:
            lease.release()
            raise

    def profile(self, name: str) -> ModelProfile | None:
        """A loaded chat model's profile (None when it is not loaded)."""
        engine = self.registry.loaded_chat(name)
        return self._served(name, engine).profile if engine is not None else None

    def vision(self, name: str) -> VisionState:
        caps = self._chats[name].caps if name in self._chats else None
        return self._vision.get(name) or VisionState(mode=caps.vision_mode if caps else "disabled")

    def _served(self, name: str, engine: Engine) -> ServedModel:
        cached = self._profiles.get(name)
        if cached is None or cached[0] is not engine:  # first use of this load: probe the template once
            chat = self._chats[name]
            profile = make_profile(name, engine.tokenizer, chat.params, engine.max_model_len, chat.caps,
                                   vocab_size=engine.vocab_size, kv_budget_tokens=engine.stats().kv_max_sequence_tokens,
                                   prompts=engine.prompts)
            self._profiles[name] = cached = (engine, profile)
        return ServedModel(cached[1], engine, self.vision(name))

    # ---- prepare ----------------------------------------------------------------------

    async def prepare_chat(self, req: ChatRequest) -> Prepared:
        """Validate, caption images, render the template and tokenize (off the event loop)."""
        if len(req.messages) > self.server.max_messages:
            raise InvalidRequestError(f"at most {self.server.max_messages} messages", param=req.messages_param)
        model, lease = await self.served(req.options.model)
        try:
            check_prompt_chars(model.profile, sum(map(len, req.texts())), req.messages_param)
            if any(m.images() for m in req.messages):  # a bad schema is refused before image work
                await anyio.to_thread.run_sync(check_constraint, model.profile, req,
                                               offered_tools(req.tools, req.tool_choice))
            images: list[Any] = []
            if model.vision.mode == "native" and model.vision.images is not None:
                messages, extras = req.messages, dict[str, Any]()
                images = await model.vision.images(req.messages)
            else:
                messages, extras = await self._see(model, req)
            prepared = await anyio.to_thread.run_sync(build_chat, model.profile, req, messages, images)
        except BaseException:
            lease.release()
            raise
        prepared.extras = {**extras, **prepared.extras}
        namespace = self.cache_namespace(req.options.cache_salt, req.options.prompt_cache_key)
        prepared.gen = replace(prepared.gen, request_id=REQUEST_ID.get(), cache_namespace=namespace)
        return self._hold(prepared, lease)

    async def prepare_text(self, req: TextRequest) -> Prepared:
        """Validate and tokenize a plain-text prompt (off the event loop)."""
        model, lease = await self.served(req.options.model)
        try:
            check_prompt_chars(model.profile, len(req.prompt), "prompt")
            gen = await anyio.to_thread.run_sync(build_text, model.profile, req)
        except BaseException:
            lease.release()
            raise
        gen = replace(gen, request_id=REQUEST_ID.get(),
                      cache_namespace=self.cache_namespace(req.options.cache_salt, req.options.prompt_cache_key))
        return self._hold(Prepared(model.profile.name, gen, req.prompt, n=req.options.n), lease)

    async def decide(self, req: DecisionRequest) -> Decision:
        """Answer ``req``'s questions from the model's distribution (``app.pipeline.decisions.reading``):
        images seen as for a chat (captions for a proxy-vision model), one prompt per question,
        its options scored on the engine, the input's KV computed once for all of them."""
        if len(req.input) > self.server.max_messages:
            raise InvalidRequestError(f"at most {self.server.max_messages} input items", param="input")
        model, lease = await self.served(req.options.model)
        try:
            profile = model.profile
            check_prompt_chars(profile, sum(map(len, req.texts())), "input")
            asked = tuple(Message("user", q.instructions, param=q.param) for q in req.questions)
            images: list[list[Any]] = []
            if model.vision.mode == "native" and model.vision.images is not None:  # it sees them itself
                seen = req.input + asked
                images = [await model.vision.images(part) for part in (req.input, *((q,) for q in asked))]
            else:
                seen, _ = await self._see(model, ChatRequest(req.options, req.input + asked, messages_param="input"))
            n = len(req.input)
            plan = await anyio.to_thread.run_sync(reading.plan, profile, seen[:n], req.questions,
                                                  [m.content for m in seen[n:]], images)
            base = GenerationRequest(
                TokenPrompt([]), 0, request_id=REQUEST_ID.get(), priority=req.options.priority,
                cache_namespace=self.cache_namespace(req.options.cache_salt, req.options.prompt_cache_key),
                cache_prefix_len=plan.prefix_len, share_prefix=True, cache_breakpoints=plan.breakpoints,
                cache_implicit=req.options.cache_implicit)
            finals = await reading.score(model.engine, plan.rows, base, reading.window(profile, plan))
        finally:
            lease.release()
        return Decision(profile.name, tuple(reading.answers(req.questions, plan.rows, finals)),
                        reading.usage(finals))

    async def count_chat(self, req: ChatRequest) -> int:
        """The prompt tokens ``req`` would use, prepared exactly as ``prepare_chat`` prepares it
        (images seen, template rendered, tokenized: a native VLM's images as their real
        runs of tokens), then dropped without generating."""
        prepared = await self.prepare_chat(req)
        assert prepared.lease is not None
        prepared.lease.release()
        return len(prepared.gen.prompt.tokens)

    @staticmethod
    def _hold(prepared: Prepared, lease: Lease[Engine]) -> Prepared:
        """The lease goes with the prepared request: released when its generation ends,
        or when it is dropped without one."""
        prepared.lease = lease
        weakref.finalize(prepared, lease.release)
        return prepared

    def cache_namespace(self, salt: str | None, key: str | None = None) -> str:
        """The prefix-cache partition of this request: its API key's (``per_key`` scope), its
        ``cache_salt`` and its ``prompt_cache_key`` (OpenAI's). Requests share cached KV only
        within one."""
        client = CLIENT.get() if self.server.prompt_cache_scope == "per_key" else ""
        if not client and not salt and not key:
            return ""
        scope = f"{client}\x00{salt or ''}" + (f"\x00{key}" if key else "")
        return hashlib.sha256(scope.encode()).hexdigest()[:24]

    async def _see(self, model: ServedModel, req: ChatRequest) -> tuple[tuple[Message, ...], dict[str, Any]]:
        """Images into text (proxy vision); refused where the model takes none."""
        if not any(m.images() for m in req.messages):
            return req.messages, {}
        vision = model.vision
        first = next(p for m in req.messages for p in m.images())
        if vision.proxy is None:
            raise VisionNotSupportedError(f"model {model.profile.name} does not accept images", param=first.param)
        if not vision.available and self._chats[model.profile.name].caps.vision_unavailable == "refuse":
            raise VisionNotSupportedError(
                f"model {model.profile.name} cannot see images now: its vision model {vision.model!r} is not "
                f"available ({vision.reason}); send the request without images", param=first.param)
        result = await vision.proxy.rewrite(req.messages, scope=self.cache_namespace(req.options.cache_salt))
        return tuple(result.messages), {"captions": [c.as_dict() for c in result.captions],
                                        "warnings": list(result.warnings)}

    # ---- generate ---------------------------------------------------------------------

    async def steps(self, p: Prepared) -> AsyncGenerator[Step, None]:
        """The generation, one ``Step`` per engine delta (choices interleaved when n > 1),
        each choice's first an empty one once the engine has queued it; closing it cancels
        every choice and lets the model go."""
        assert p.lease is not None, "a prepared request holds its model's lease"
        try:
            if p.n == 1:
                async with aclosing(self._choice(p, p.gen, 0)) as steps:
                    async for step in steps:
                        yield step
            else:
                async with aclosing(self._choices(p)) as steps:
                    async for step in steps:
                        yield step
        finally:
            p.lease.release()

    async def _choice(self, p: Prepared, gen: GenerationRequest, index: int) -> AsyncGenerator[Step, None]:
        """One generation through its own parser."""
        assert p.lease is not None
        parser = None
        if p.parser is not None:
            parser = make_parser(p.parser, reasoning=p.parse_reasoning, starts_in_reasoning=p.starts_in_reasoning,
                                 tools_offered=p.tools_offered, tools=p.tools, primer=p.primer)
        prediction = gen.speculation.prediction if gen.speculation is not None else ()
        written: list[str] = []  # the answer's text, kept only to count the prediction against it
        async with aclosing(p.lease.handle.stream(replace(gen, announce_queued=True))) as deltas:
            async for delta in deltas:
                if not delta.tokens and delta.finish_reason is None:  # queued
                    yield Step([], index=index, tokens=0)
                    continue
                if prediction:
                    written.append(delta.text)
                events = parser.feed(delta.text) if parser is not None and delta.text else []
                usage = None
                if delta.finish_reason is not None:
                    if parser is not None:
                        events += parser.finish()
                    accepted, rejected = (await asyncio.to_thread(
                        prediction_usage, p.lease.handle.tokenizer, prediction, "".join(written))
                        if prediction else (0, 0))
                    usage = Usage(delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens,
                                  delta.reasoning_tokens, accepted, rejected, delta.cache_write_tokens)
                if not p.emit_reasoning:
                    events = [ev for ev in events if not isinstance(ev, ReasoningDelta)]
                logprobs = logprob_infos(p.lease.handle.tokenizer, delta.logprobs) if delta.logprobs else []
                yield Step(events, delta.text, delta.finish_reason, usage, index, logprobs, delta.stop_sequence,
                           delta.tokens)

    async def _choices(self, p: Prepared) -> AsyncGenerator[Step, None]:
        """``n`` generations of one prompt: the first computes the prompt's KV and leaves it
        in the prefix cache (its own namespace); the others start once it has, and reuse it."""
        queue: asyncio.Queue[Step | BaseException] = asyncio.Queue()
        prompt_cached = asyncio.Event()

        async def run(index: int) -> None:
            gen = p.gen
            if index == 0:
                gen = replace(gen, share_prefix=True, cache_prefix_len=max(1, len(gen.prompt_tokens) - 1))
            elif gen.sampling.seed is not None:  # one seed for the request, a different draw per choice
                gen = replace(gen, sampling=replace(gen.sampling, seed=(gen.sampling.seed + index) % 2**64))
            try:
                if index:
                    await prompt_cached.wait()
                async with aclosing(self._choice(p, gen, index)) as steps:
                    async for step in steps:
                        if step.tokens or step.finish_reason is not None:  # not just queued: prefilled
                            prompt_cached.set()
                        await queue.put(step)
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put(exc)
            finally:
                prompt_cached.set()  # never leave the others waiting on a choice that failed

        tasks = [asyncio.ensure_future(run(i)) for i in range(p.n)]
        try:
            finished = 0
            while finished < p.n:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished += item.finish_reason is not None
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(self, p: Prepared) -> Completion:
        """The whole generation, folded from the same steps as a stream."""
        async with aclosing(self.steps(p)) as steps:
            return Completion.fold([s async for s in steps])

    async def complete_choices(self, p: Prepared) -> list[Completion]:
        """Every choice of the generation (``n``), folded from the same steps as a stream."""
        async with aclosing(self.steps(p)) as steps:
            return Completion.fold_choices([s async for s in steps])

    # ---- encoders ---------------------------------------------------------------------

    async def embed(self, req: EmbedRequest) -> tuple[Embeddings, int]:
        """The vectors of ``req.input`` from an embedding model, and their dimension."""
        lease = await self.registry.acquire_encoder(req.model)
        note_model(lease.name)
        try:
            engine = lease.handle
            encoder = engine.encoder
            if req.dimensions is not None and req.dimensions != encoder.dim:
                raise InvalidRequestError(f"model {req.model!r} gives {encoder.dim}-dimensional vectors; "
                                          f"dimensions {req.dimensions} cannot be served", param="dimensions")
            encoder.check_size(req.input)
            tokens, vectors = await engine.encode(lambda: encoder.prepare_embed(req.input, truncate=req.truncate))
            note_model(lease.name, sum(len(t) for t in tokens.ids))
            return encoder.embeddings(tokens, vectors), encoder.dim
        finally:
            lease.release()

    async def rerank(self, req: RerankRequest) -> Ranking:
        """Relevance of each document to ``req.query``: cosine with an embedding model, the
        classifier's score with a cross-encoder (``role: rerank``)."""
        lease = await self.registry.acquire_encoder(req.model, rerank=True)
        note_model(lease.name)
        try:
            engine = lease.handle
            encoder = engine.encoder
            encoder.check_size(EncoderInputs(req.documents, "documents"))
            tokens, result = await engine.encode(
                lambda: encoder.prepare_rerank(req.query, req.documents, truncate=req.truncate))
            note_model(lease.name, sum(len(t) for t in tokens.ids))
            return encoder.ranking(tokens, result)
        finally:
            lease.release()


# ---- the CPU work, in a worker thread ---------------------------------------------------


@functools.lru_cache(maxsize=8)
def _longest_token_chars(tokenizer: Any) -> int:
    return max(map(len, tokenizer.get_vocab()))


def check_prompt_chars(profile: ModelProfile, chars: int, param: str) -> None:
    """Refuse, before tokenizing, a prompt that cannot fit the context whatever its tokens.

    A token spans at most the longest vocabulary entry in characters, so a prompt
    of more than max_model_len times that cannot fit (doubled, for normalizers
    that merge characters). Tokenizing megabytes takes seconds of CPU; this takes none.
    """
    limit = 2 * profile.max_model_len * _longest_token_chars(profile.tokenizer)
    if chars > limit:
        raise ContextLengthError(
            f"this model's maximum context length is {profile.max_model_len} tokens; "
            f"a prompt of {chars} characters cannot fit (at most {limit} are accepted)",
            param=param,
        )


def with_tools(profile: ModelProfile, req: ChatRequest, messages: tuple[Message, ...]
               ) -> tuple[list[Message], tuple[Tool, ...], list[dict[str, Any]] | None]:
    """One system message first (consecutive turns of one role merged, where the template
    demands alternation), and the offered tools: for the template when it renders tools, else
    as a compact note in that system message. Returns the messages, the tools offered, and
    what to pass the template as ``tools``."""
    msgs = gather_system(profile, messages)
    if profile.alternating:
        msgs = merge_turns(msgs)
    tools = offered_tools(req.tools, req.tool_choice)
    if not tools:
        return msgs, tools, None
    if profile.template_takes_tools:
        return msgs, tools, [t.as_dict() for t in tools]
    syntax = profile.call_syntax if isinstance(profile.call_syntax, CallSyntax) else BARE_JSON
    note = tool_note(tools, req.tool_choice.mode == "required", syntax)
    if msgs and msgs[0].role == "system":
        msgs[0] = msgs[0].with_text(f"{msgs[0].text()}\n\n{note}")
    else:
        msgs.insert(0, Message.of("system", note))
    return msgs, tools, None


def build_chat(profile: ModelProfile, req: ChatRequest, messages: tuple[Message, ...] | None = None,
               images: Sequence[Image] = ()) -> Prepared:
    """Render, tokenize and bound a chat request through the model's prompt builder.
    ``messages`` replaces the request's (the vision proxy's rewrite, images turned into
    text); ``images`` are the request's images in order, for a builder that takes them
    (native vision: its template places them, its processor expands them)."""
    source = req.messages if messages is None else messages
    wanted = profile.reasoning if req.thinking is None else (req.thinking and profile.reasoning)
    text, tools, dicts = render_chat(profile, req, source, wanted)
    check_within(profile.tokenizer, text, profile.max_model_len, req.messages_param)
    prompt = profile.prompts.build(text, images)
    tokens = prompt.tokens
    gen = GenerationRequest(
        prompt=prompt,
        max_tokens=completion_budget(profile, len(tokens), req.options, req.messages_param),
        sampling=sampling_for(profile, req.options),
        stop=req.options.stop,
        cache_prefix_len=_cache_prefix_len(profile, dicts, tokens, wanted, req)
        if len(dicts) > 1 and isinstance(prompt, TokenPrompt) else None,
        priority=_priority(req),
        logprobs=req.options.logprobs,
        constraint=_constraint(profile, req, tools, text, wanted),
        reasoning=reasoning_block(profile, req, text, wanted),
        speculation=speculation_for(profile, req.options),
        cache_breakpoints=_breakpoints(profile, req, source, prompt, wanted),
        cache_implicit=req.options.cache_implicit,
    )
    return _parsed_as(profile, req, gen, text, wanted, tools)


def render_chat(profile: ModelProfile, req: ChatRequest, messages: tuple[Message, ...], wanted: bool
                ) -> tuple[str, tuple[Tool, ...], list[dict[str, Any]]]:
    """The request's prompt text with ``messages`` (its own, or rewritten): the tools offered
    (``with_tools``), every message as the template takes it, the template applied. Returns
    the text, the tools offered and the messages as rendered."""
    msgs, tools, template_tools = with_tools(profile, req, messages)
    dicts = template_messages(msgs, profile.family, images=profile.prompts.takes_images)
    text = render(profile, dicts, template_tools, wanted, effort=req.reasoning_effort,
                  budget=thinking_budget(profile, req))
    return text, tools, dicts


def _breakpoints(profile: ModelProfile, req: ChatRequest, messages: tuple[Message, ...], prompt: Prompt,
                 wanted: bool) -> tuple[CacheBreakpoint, ...]:
    """Where the client's cache marks end in the prompt (``breakpoints``); none yet for a
    native VLM's prompt, whose image runs the text alone does not place."""
    if not isinstance(prompt, TokenPrompt):
        return ()

    def variant(msgs: tuple[Message, ...], tools: tuple[Tool, ...]) -> list[int]:
        return profile.prompts.build(render_chat(profile, replace(req, tools=tools), msgs, wanted)[0]).tokens

    return breakpoints(prompt.tokens, messages, req.tools, variant)


def _parsed_as(profile: ModelProfile, req: ChatRequest, gen: GenerationRequest, text: str, wanted: bool,
               offered: tuple[Tool, ...]) -> Prepared:
    """How the model's output is read: its family's parser, reasoning, tool calls."""
    parse_reasoning = _reads_reasoning(profile, wanted)
    extras = {"prompt": text} if req.options.extensions else {}
    tools_offered = bool(offered)
    return Prepared(profile.name, gen, text, profile.parser, parse_reasoning, wanted,
                    parse_reasoning and profile.opens_reasoning(text), tools_offered, extras, n=req.options.n,
                    tools={t.name: t.parameters for t in offered}, primer=profile.opened_call(text))


def _reads_reasoning(profile: ModelProfile, wanted: bool) -> bool:
    """Whether the output's reasoning block is read: whenever the model reasons. With thinking
    off a model may reason anyway (a template with no switch renders the same prompt either
    way, and LFM2.5 reasons whatever its switch says): its reasoning is still read, so
    markers never reach the content, and it is not sent (``Prepared.emit_reasoning``)."""
    return profile.reasoning


# Effort levels past the table's top, as clients name them (OpenAI's xhigh, Anthropic's max).
EFFORT_ALIASES = {"xhigh": "high", "max": "high"}


def thinking_budget(profile: ModelProfile, req: ChatRequest) -> int | None:
    """The request's reasoning budget in tokens: its explicit budget, else its effort level's
    (``capabilities.reasoning_budgets``), within the context; None for no limit (no effort
    named, or one the table does not know, "none" included: that one switches thinking off,
    and a model that reasons anyway is not cut short, whose answer would then be its thoughts)."""
    if req.reasoning_budget is not None:
        return min(req.reasoning_budget, profile.max_model_len)
    if req.reasoning_effort is None:
        return None
    level = EFFORT_ALIASES.get(req.reasoning_effort, req.reasoning_effort)
    return dict(profile.reasoning_budgets).get(level)


def reasoning_block(profile: ModelProfile, req: ChatRequest, text: str, wanted: bool) -> ReasoningBlock | None:
    """The reasoning block the engine tracks (its tokens reported in usage) and, with a
    budget, ends by writing the model's own closer; None when reasoning is not read."""
    if not _reads_reasoning(profile, wanted):
        return None
    opener, closer = profile.reasoning_markers
    close_ids = tuple(profile.tokenizer.encode(closer, add_special_tokens=False))
    return ReasoningBlock(opener, closer, close_ids, started=profile.opens_reasoning(text),
                          budget=thinking_budget(profile, req))


def _constraint(profile: ModelProfile, req: ChatRequest, tools: tuple[Tool, ...], text: str,
                wanted: bool) -> Grammar | None:
    """The compiled output constraint (response_format, forced tool calls), reasoning first."""
    spec = constraint_spec(profile, req, tools)
    if spec is None:
        return None
    # The grammar lets a reasoning block through only when thinking is on: with it off a model
    # would spend its tokens wandering in one, and one the prompt opened anyway is closed at once.
    reasoning = reasoning_for(profile, text, profile.reasoning and wanted)
    if reasoning is None and profile.reasoning and not wanted and profile.opens_reasoning(text):
        opener, closer = profile.reasoning_markers
        reasoning = Reasoning(opener, closer, started=True, closed=True)
    return compile_constraint(profile, spec, reasoning, req.output.param)


def build_text(profile: ModelProfile, req: TextRequest) -> GenerationRequest:
    """Tokenize and bound a plain-text prompt."""
    tokens = encode(profile, req.prompt, "prompt", special_tokens=True)
    if not tokens:
        raise InvalidRequestError("prompt is empty", param="prompt")
    return GenerationRequest(
        prompt=TokenPrompt(tokens),
        max_tokens=completion_budget(profile, len(tokens), req.options, "prompt"),
        sampling=sampling_for(profile, req.options),
        stop=req.options.stop,
        priority=req.options.priority,
        logprobs=req.options.logprobs,
        speculation=speculation_for(profile, req.options),
    )


def speculation_for(profile: ModelProfile, options: Options) -> SpeculationRequest | None:
    """What the request asks of speculative decoding: its prediction as the model's tokens (no
    special tokens: it is answer text), and its switches; None leaves the model's defaults."""
    spec = options.speculation
    if spec == Speculation():
        return None
    prediction: tuple[int, ...] = ()
    if spec.prediction:
        # A prediction longer than the context could never be the answer: refused like a prompt.
        prediction = tuple(encode_within(profile.tokenizer, spec.prediction, profile.max_model_len, "prediction"))
    return SpeculationRequest(prediction, spec.prompt_lookup, spec.draft)


def _priority(req: ChatRequest) -> Priority:
    if req.options.priority != "interactive":
        return req.options.priority
    last_user = next((m for m in reversed(req.messages) if m.role == "user"), None)
    if last_user is not None and last_user.text().lstrip().startswith(BACKGROUND_TASK_PREFIX):
        return "background"
    return "interactive"


def sampling_for(profile: ModelProfile, options: Options) -> SamplingParams:
    """The request's sampling over the model's defaults."""
    s, d = options.sampling, profile.params
    top_k = s.top_k if s.top_k is not None else d.top_k
    vocab = profile.vocab_size
    if vocab and top_k >= vocab:
        # Keeping every token is no top-k at all; mlx-lm would raise mid-batch, failing its neighbours.
        top_k = 0
    for token, _ in s.logit_bias:
        if vocab and not 0 <= token < vocab:
            raise InvalidRequestError(f"logit_bias: {token} is not a token id of this model (0..{vocab - 1})",
                                      param="logit_bias")
    pick: Callable[[str], Any] = lambda name: v if (v := getattr(s, name)) is not None else getattr(d, name)  # noqa: E731
    temperature, top_p = pick("temperature"), pick("top_p")
    if temperature < SAMPLING_EPSILON or top_p < SAMPLING_EPSILON:
        temperature, top_p = 0.0, 1.0  # their limit: the most likely token
    return SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=pick("min_p"),
        frequency_penalty=pick("frequency_penalty"), presence_penalty=pick("presence_penalty"),
        repetition_penalty=pick("repetition_penalty"), seed=s.seed, logit_bias=s.logit_bias,
    )


def completion_budget(profile: ModelProfile, prompt_len: int, options: Options, prompt_param: str) -> int:
    """max_tokens, clamped to what the context leaves after the prompt: the one rule, for
    every prompt kind, on its exact tokens (a native VLM's image runs expanded).

    Clients ask for more than a local model's context as a matter of course
    (Claude Code sends max_tokens 32000); they get what fits, not a refusal.
    """
    room = completion_room(prompt_len, profile.max_model_len, profile.kv_budget_tokens, prompt_param)
    wanted = options.max_tokens if options.max_tokens is not None else profile.params.max_tokens
    return min(wanted, room)


def _cache_prefix_len(profile: ModelProfile, messages: list[dict[str, Any]], tokens: list[int],
                      thinking: bool, req: ChatRequest) -> int | None:
    """Tokens of the system prompt (or first exchange) that stand alone as a prefix."""
    mode = profile.params.prompt_cache
    if mode == "off":
        return None
    upto = 1 if messages[0]["role"] == "system" else 0
    if mode == "first_message" and len(messages) > upto:
        upto += 1
    if upto == 0 or upto >= len(messages):
        return None
    head = encode(profile, render(profile, messages[:upto], None, thinking, generation_prompt=False,
                                  effort=req.reasoning_effort, budget=thinking_budget(profile, req)))
    return len(head) if head and tokens[: len(head)] == head else None


def log_generation(record: GenerationRecord) -> None:
    """The one log line of every generation that ended (an engine listener)."""
    error = f" ({record.error})" if record.error else ""
    log.info(
        "generation %s%s: prompt_tokens=%d cached_tokens=%d completion_tokens=%d ttft_s=%s total_s=%.3f",
        record.outcome, error, record.prompt_tokens, record.cached_tokens, record.completion_tokens,
        "-" if record.ttft_s is None else f"{record.ttft_s:.3f}", record.total_s,
        extra={"request_id": record.request_id or "-"},
    )
