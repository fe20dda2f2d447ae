"""A decision request and its answers, typed: what ``POST /v1/decisions`` parses into.

Questions about one input, each answered from the model's distribution over the
question's options (``app.pipeline.decisions.reading`` reads it). Here are the types and the
rules that turn an option's log-probability into the answer a client gets, kept stable
because clients set thresholds on them:

    probability   p_i = exp(s_i) / sum_j exp(s_j), over the question's options, where s_i
                  is the log-probability the model gives option i (its written forms,
                  "Yes" or "yes") as the start of its answer. A predicate's probability is
                  its "Yes" option's.
    confidence    (N * max_i p_i - 1) / (N - 1) for N options: 0 when every option is as
                  likely as the others, 1 when one holds all the probability.
    score         sum_i p_i * i over a score question's levels, numbered from 0 in the
                  order given: the expected level, which may fall between two.
    refusal       the question is refused when its options together hold less than
                  ``REFUSAL_FLOOR`` of the model's probability at the answer position,
                  sum_i exp(s_i): the model wanted to say something else (a word of its
                  own, a sentence, a refusal), so no option is its answer.

The request's limits are OpenAI's: 1 to 400 questions, 2 to 255 distinct choices, 2 to 10
levels; each refusal names the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from app.errors import InvalidRequestError
from app.pipeline.request import Message, Options, Part, TextPart
from app.pipeline.results import Usage

QuestionKind = Literal["predicate", "choice", "score"]

MAX_QUESTIONS = 400
CHOICES = (2, 255)
LEVELS = (2, 10)
# Below this total probability on its options, a question is refused (see the module docstring).
REFUSAL_FLOOR = 0.05


@dataclass(frozen=True)
class Choice:
    """One value a choice question may take: a string and a boolean of the same text differ."""

    value: str | bool
    description: str | None = None


@dataclass(frozen=True)
class Level:
    """One level of a score question's ordered scale."""

    label: str
    description: str | None = None


@dataclass(frozen=True)
class Question:
    """One question about the input."""

    kind: QuestionKind
    # What to decide: text and images (and JSON, as text), as the client wrote it.
    instructions: tuple[Part, ...]
    name: str | None = None
    choices: tuple[Choice, ...] = ()
    levels: tuple[Level, ...] = ()
    # Where the question sits in the client's request, for errors: "questions[3]".
    param: str = ""

    @property
    def size(self) -> int:
        """How many options the answer is read over."""
        return {"predicate": 2, "choice": len(self.choices), "score": len(self.levels)}[self.kind]

    def check(self) -> None:
        """Refuse what cannot be asked, naming the field."""
        if not any(p.text.strip() if isinstance(p, TextPart) else True for p in self.instructions):
            raise InvalidRequestError(f"{self.param}.instructions: empty", param=f"{self.param}.instructions")
        if self.kind == "choice":
            _bounded(len(self.choices), CHOICES, "choices", self.param)
            seen: set[tuple[type, str | bool]] = set()
            for i, c in enumerate(self.choices):
                where = f"{self.param}.choices[{i}].value"
                if isinstance(c.value, str) and not c.value.strip():
                    raise InvalidRequestError(f"{where}: an empty string cannot be an answer", param=where)
                key = (type(c.value), c.value)
                if key in seen:
                    raise InvalidRequestError(f"{where}: {c.value!r} is a duplicate; choices must be unique",
                                              param=where)
                seen.add(key)
        elif self.kind == "score":
            _bounded(len(self.levels), LEVELS, "levels", self.param)
            for i, level in enumerate(self.levels):
                if not level.label.strip():
                    where = f"{self.param}.levels[{i}].label"
                    raise InvalidRequestError(f"{where}: empty", param=where)


def _bounded(n: int, bounds: tuple[int, int], field: str, param: str) -> None:
    low, high = bounds
    if not low <= n <= high:
        raise InvalidRequestError(f"{param}.{field}: give {low} to {high}, not {n}", param=f"{param}.{field}")


@dataclass(frozen=True)
class DecisionRequest:
    """Questions about one input, answered from one chat model."""

    # The model, and the prefix cache's scope (cache_salt, prompt_cache_key, the cache mode).
    options: Options
    # The input every question is about: a user message (a string, or text and images), or a
    # conversation (system, user and assistant turns, tool calls and their results).
    input: tuple[Message, ...]
    questions: tuple[Question, ...]

    def __post_init__(self) -> None:
        if not any(m.images() or m.tool_calls or m.text().strip() for m in self.input):
            raise InvalidRequestError("input: empty", param="input")
        if not 1 <= len(self.questions) <= MAX_QUESTIONS:
            raise InvalidRequestError(f"questions: give 1 to {MAX_QUESTIONS}, not {len(self.questions)}",
                                      param="questions")
        for q in self.questions:
            q.check()

    def texts(self) -> list[str]:
        """Every text that reaches the prompt: the prompt-size pre-check counts them."""
        out = [p.text for m in self.input for p in m.content if isinstance(p, TextPart)]
        out += [t for m in self.input for tc in m.tool_calls for t in (tc.name, tc.arguments)]
        for q in self.questions:
            out += [p.text for p in q.instructions if isinstance(p, TextPart)]
            out += [str(c.value) + (c.description or "") for c in q.choices]
            out += [level.label + (level.description or "") for level in q.levels]
        return out


@dataclass(frozen=True)
class Answer:
    """A question's answer, read from its options' log-probabilities."""

    question: Question
    # Per option in the question's order (a predicate's: Yes, No); empty when refused.
    probabilities: tuple[float, ...]
    # The options' total probability at the answer position (the refusal rule's figure).
    mass: float

    @classmethod
    def read(cls, question: Question, logprobs: Sequence[float]) -> Answer:
        """The answer to ``question`` given each option's log-probability."""
        top = max(logprobs)
        weights = [math.exp(s - top) for s in logprobs]
        total = sum(weights)
        mass = total * math.exp(top)
        if mass < REFUSAL_FLOOR:
            return cls(question, (), mass)
        return cls(question, tuple(w / total for w in weights), mass)

    @property
    def refused(self) -> bool:
        return not self.probabilities

    @property
    def best(self) -> int:
        """The most likely option's index (the first of equals)."""
        return max(range(len(self.probabilities)), key=self.probabilities.__getitem__)

    @property
    def confidence(self) -> float:
        n = len(self.probabilities)
        return max(0.0, min(1.0, (n * max(self.probabilities) - 1) / (n - 1)))

    @property
    def expected(self) -> float:
        """The expected level of a score question."""
        return sum(i * p for i, p in enumerate(self.probabilities))


@dataclass(frozen=True)
class Decision:
    """Every question's answer, in question order, and what the model read."""

    model: str
    answers: tuple[Answer, ...]
    # Prompt tokens of every question's prompt (the input's counted as cached for all but the
    # rows that computed it), what the prefix cache gave, and what it was given.
    usage: Usage
