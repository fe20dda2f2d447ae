"""How a decision is read from a chat model: one prompt per question, its options scored.

Each question is one user turn through the model's own chat template: the input first
(a user message's text and images as they are; a conversation as a transcript, one line
per turn, tool calls and their results named), then the question, its options listed, and
how to answer:

    <input>

    Statement:                           Question:                   Question:
    <instructions>                       <instructions>              <instructions>
    Is this statement true of the        Options:                    Levels, from lowest to highest:
    input above? Answer Yes or No,       - billing: Invoices         0: Cosmetic (No lost function)
    and nothing else.                    - bug                       1: Blocked
                                         Answer with exactly one     Answer with the number of one
                                         of the options, ...         level, and nothing else.

The answer is read where the assistant's answer starts, from the model's distribution,
never from text it writes. An option is the text the model would write: "Yes" and "No", a
choice's value ("true" and "false" for booleans), a level's number; and the same with its
first letter's case turned ("Billing" for "billing"), which the model may write as well:
an option's probability is its forms' together. A form's tokens are the ones the tokenizer
gives it right after the prompt. When no two options' forms start with the same token, one
row reads them all at once (``ScoreRequest.next_tokens``); when two do, every form is scored
as its whole token sequence (a row each, ``ScoreRequest.tail``; a form that is the start of
another option's is followed by the end-of-turn token, so it means that option and nothing
longer).

A reasoning model answers with its reasoning closed, as a thinking budget of 0 closes it:
a template with a thinking switch renders with thinking off; a prompt that opens the block
gets its closer; a model trained to reason unasked (no switch, its opener one special
token, as Ministral's ``[THINK]``) gets the empty block it writes under a budget of 0. A
model whose opener is plain text (``<think>`` in several tokens) is read at once: under a
budget of 0 it answers without opening a block.

A native vision model sees the input's images in its prompts (each question's prompt is
built with them by the model's processor; the vision tower runs once per image, its
features cached); a proxy-vision model gets them as captions before this.

Cost: every question's prompt starts with the same input, and its rows declare where
that shared prefix ends (``cache_prefix_len``), so the engine computes the input's KV once
(the first row that reaches it; the others wait for it) and every other row of the
request, and any later request about the same input, reads it from the prefix cache. The
rows are the engine step's score rows: they share batch steps with chat, at most a
batch's worth of them in the engine at a time.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from app.engine import (
    KV_STEP,
    CacheBreakpoint,
    Engine,
    GenerationRequest,
    MultimodalPrompt,
    Prompt,
    ScoreRequest,
    TokenDelta,
    TokenPrompt,
)
from app.errors import EngineError
from app.pipeline.breakpoints import breakpoints, common_length
from app.pipeline.decisions.request import Answer, Question
from app.pipeline.prompting import ModelProfile, encode, render, template_messages
from app.pipeline.request import Message, Part, TextPart
from app.pipeline.results import Usage

# How a transcript names each turn.
ROLE_LABELS = {"system": "System", "user": "User", "assistant": "Assistant"}
# What follows a closed reasoning block before the answer, by closer (Qwen3's template writes
# "<think>\n\n</think>\n\n" for a turn without reasoning; Mistral's [/THINK] runs straight on).
AFTER_CLOSER = {"</think>": "\n\n"}
PREDICATE_OPTIONS = ("Yes", "No")


@dataclass(frozen=True)
class Row:
    """One prompt to score for question ``question``: the option each candidate next token
    stands for, or the one option whose written form ends the prompt (its ``tail``)."""

    question: int
    options: tuple[int, ...]
    prompt: Prompt
    score: ScoreRequest

    @property
    def tokens(self) -> list[int]:
        return self.prompt.tokens


def extended(prompt: Prompt, tokens: list[int]) -> Prompt:
    """``prompt`` with ``tokens`` after it (an option's written form); its images kept."""
    if not tokens:
        return prompt
    if isinstance(prompt, MultimodalPrompt):
        return replace(prompt, tokens=[*prompt.tokens, *tokens])
    return TokenPrompt([*prompt.tokens, *tokens])


@dataclass(frozen=True)
class Plan:
    """A decision's prompts: its rows, where their shared input ends, the client's breakpoints."""

    rows: list[Row]
    prefix_len: int
    breakpoints: tuple[CacheBreakpoint, ...]


# ---- the prompts ------------------------------------------------------------------------


def labels(question: Question) -> list[str]:
    """The text of each option, as the model is asked to write it."""
    if question.kind == "predicate":
        return list(PREDICATE_OPTIONS)
    if question.kind == "choice":
        return [json.dumps(c.value) if isinstance(c.value, bool) else c.value for c in question.choices]
    return [str(i) for i in range(len(question.levels))]


def question_parts(question: Question) -> list[Part]:
    """The question as the end of the user turn, after the input (a blank line between)."""
    names = labels(question)
    if question.kind == "predicate":
        head = "Statement:"
        ask = "Is this statement true of the input above? Answer Yes or No, and nothing else."
    elif question.kind == "choice":
        head = "Question:"
        lines = [f"- {n}: {c.description}" if c.description else f"- {n}" for n, c in zip(names, question.choices)]
        ask = "\n".join(["Options:", *lines,
                         "Answer with exactly one of the options, written as above, and nothing else."])
    else:
        head = "Question:"
        lines = [f"{n}: {lv.label} ({lv.description})" if lv.description else f"{n}: {lv.label}"
                 for n, lv in zip(names, question.levels)]
        ask = "\n".join(["Levels, from lowest to highest:", *lines,
                         "Answer with the number of one level, and nothing else."])
    return [TextPart(f"\n{head}"), *question.instructions, TextPart(ask)]


def input_parts(messages: Sequence[Message]) -> list[Part]:
    """The input as the start of the user turn: a lone user message as it is; a conversation
    as a transcript, each turn led by its role, tool calls and results named."""
    if len(messages) == 1 and messages[0].role == "user" and not messages[0].tool_calls:
        return list(messages[0].content)
    out: list[Part] = []
    for m in messages:
        lead = f"Result of call {m.tool_call_id}" if m.role == "tool" else ROLE_LABELS[m.role]
        parts = list(m.content)
        if parts and isinstance(parts[0], TextPart):
            parts[0] = replace(parts[0], text=f"{lead}: {parts[0].text}")
        elif parts:
            parts.insert(0, TextPart(f"{lead}:"))
        out += parts
        out += [TextPart(f"Assistant called {c.name}({c.arguments}) [call {c.id}]") for c in m.tool_calls]
    return out


def _prompt_text(profile: ModelProfile, turn: Message) -> str:
    """The one user turn through the chat template, the assistant's answer about to start,
    reasoning closed."""
    text = render(profile, template_messages([turn], profile.family, images=profile.prompts.takes_images), None,
                  False)
    if not profile.reasoning:
        return text
    opener, closer = profile.reasoning_markers
    after = AFTER_CLOSER.get(closer, "")
    if profile.opens_reasoning(text):
        return text + closer + after
    if not profile.thinking_switch and profile.reasoning_opener_is_token:
        return text + opener + closer + after  # trained to reason unasked: the empty block of a budget of 0
    return text


def continuation(profile: ModelProfile, prompt: list[int], label: str) -> list[int]:
    """``label``'s tokens as they follow the prompt: the prompt's last tokens are tokenized
    with it, so a tokenizer that joins across the boundary is asked, not guessed."""
    tokenizer = profile.tokenizer
    context = tokenizer.decode(prompt[-8:])
    head = list(tokenizer.encode(context, add_special_tokens=False))
    full = list(tokenizer.encode(context + label, add_special_tokens=False))
    if full[:len(head)] == head and len(full) > len(head):
        return full[len(head):]
    return list(tokenizer.encode(label, add_special_tokens=False))


def forms(names: list[str]) -> list[list[str]]:
    """Each option's written forms: its label, and the label with its first letter's case
    turned ("billing", "Billing"; "Yes", "yes") unless that is another option's label."""
    taken = set(names)
    out = []
    for name in names:
        turned = name[:1].swapcase() + name[1:]
        out.append([name] + ([turned] if turned != name and turned not in taken else []))
    return out


def option_rows(profile: ModelProfile, index: int, question: Question, prompt: Prompt) -> list[Row]:
    """The rows that read ``question``'s options after its ``prompt``: one for them all when
    no two options' forms start with the same token, else one per form, read whole."""
    written = [[continuation(profile, prompt.tokens, f) for f in fs] for fs in forms(labels(question))]
    firsts = [{tokens[0] for tokens in option} for option in written]
    if sum(map(len, firsts)) == len(set().union(*firsts)):  # no first token in two options
        owners = [(t, i) for i, ts in enumerate(firsts) for t in sorted(ts)]
        return [Row(index, tuple(i for _, i in owners), prompt, ScoreRequest(next_tokens=tuple(t for t, _ in owners)))]
    end = profile.tokenizer.eos_token_id
    rows = []
    for i, option in enumerate(written):
        others = [o for j, other in enumerate(written) if j != i for o in other]
        for tokens in option:
            if isinstance(end, int) and any(len(o) > len(tokens) and o[:len(tokens)] == tokens for o in others):
                tokens = [*tokens, end]  # it means this option, not the longer one it starts
            rows.append(Row(index, (i,), extended(prompt, tokens), ScoreRequest(tail=len(tokens))))
    return rows


def plan(profile: ModelProfile, inputs: Sequence[Message], questions: Sequence[Question],
         asked: Sequence[tuple[Part, ...]], images: Sequence[Sequence[Any]] = ()) -> Plan:
    """Every question's prompt and rows (``asked``: each question's instructions as the model
    sees them, images captioned for a proxy-vision model), and where the shared input ends.
    ``images``, for a native vision model: the input's, then each question's, in order (its
    processor runs on the MLX thread). CPU work, for a worker thread."""
    head = input_parts(inputs)
    seen = list(images) or [[]]

    def build(text: str, more: int | None = None) -> Prompt:
        """``text`` as tokens, with the input's images and question ``more``'s, where the model takes them."""
        pictures = [*seen[0], *(seen[1 + more] if more is not None and len(seen) > 1 + more else ())]
        if profile.prompts.takes_images and pictures:
            return profile.prompts.build(text, pictures)
        return TokenPrompt(encode(profile, text, "input"))

    rows: list[Row] = []
    prompts: list[list[int]] = []
    for i, (question, instructions) in enumerate(zip(questions, asked)):
        turn = Message("user", (*head, *question_parts(replace(question, instructions=instructions))))
        prompt = build(_prompt_text(profile, turn), i)
        prompts.append(prompt.tokens)
        rows += option_rows(profile, i, question, prompt)
    # Where the input ends: where a question's prompt parts from one with another question.
    probe = build(_prompt_text(profile, Message("user", (*head, TextPart("\n\u2063"))))).tokens
    prefix = min(common_length(probe, p) for p in prompts)

    def variant(messages: tuple[Message, ...], _tools: object) -> list[int]:
        return build(_prompt_text(profile, messages[0]), 0).tokens

    first = Message("user", (*head, *question_parts(replace(questions[0], instructions=asked[0]))))
    marked = breakpoints(prompts[0], (first,), (), variant)
    return Plan(rows, prefix, tuple(b for b in marked if b.tokens <= prefix))


def window(profile: ModelProfile, plan: Plan) -> int:
    """How many rows a request keeps in the engine at once: a batch's worth (``max_num_seqs``),
    fewer where that many rows' KV and the cached input would not fit the KV budget together
    (the input would be evicted between the turns that read it, and computed again)."""
    longest = max(len(r.tokens) for r in plan.rows)
    budget = profile.kv_budget_tokens or profile.max_model_len
    fits = (budget - plan.prefix_len) // (longest + KV_STEP)
    return max(1, min(profile.params.max_num_seqs, fits))


# ---- the answers ------------------------------------------------------------------------


async def score(engine: Engine, rows: list[Row], base: GenerationRequest, window: int) -> list[TokenDelta]:
    """Every row's final delta, at most ``window`` rows in the engine at a time (the first to
    reach the shared input computes it; the engine holds the others until it is cached);
    the first error cancels the rest."""
    gate = asyncio.Semaphore(max(1, window))

    async def one(row: Row) -> TokenDelta:
        async with gate:
            req = replace(base, prompt=row.prompt, score=row.score)
            async with aclosing(engine.stream(req)) as deltas:
                async for delta in deltas:
                    if delta.finish_reason is not None:
                        return delta
        raise EngineError("the engine ended a scored row without its answer")

    tasks = [asyncio.ensure_future(one(r)) for r in rows]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def answers(questions: Sequence[Question], rows: list[Row], finals: list[TokenDelta]) -> list[Answer]:
    """Each question's answer from its rows' scores."""
    found: list[list[list[float]]] = [[[] for _ in range(q.size)] for q in questions]
    for row, final in zip(rows, finals):
        assert final.scores is not None
        if row.score.next_tokens:
            for option, logprob in zip(row.options, final.scores.next_tokens):
                found[row.question][option].append(logprob)
        else:
            found[row.question][row.options[0]].append(sum(final.scores.tail))
    return [Answer.read(q, [_logsumexp(forms) for forms in per_option]) for q, per_option in zip(questions, found)]


def _logsumexp(values: list[float]) -> float:
    """log(sum(exp(v))): an option's probability over its written forms."""
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def usage(finals: list[TokenDelta]) -> Usage:
    """The request's usage: every row's prompt, what the cache gave and took; nothing generated."""
    return Usage(sum(f.prompt_tokens for f in finals), 0, sum(f.cached_tokens for f in finals),
                 cache_write_tokens=sum(f.cache_write_tokens for f in finals))

