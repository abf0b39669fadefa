"""FinQA, HotPotQA, MuSiQue and your own question-answer JSONL, as in the paper.

Each dataset parses its native schema into :class:`Example` rows (raising :class:`BadRow` with
the reason for a malformed one), linearises the input x*, and scores answers:

* training reward: exact match of the extracted answer (:func:`~nemo_jq.data.answers.text_exact_match`
  after SQuAD normalisation for HotPotQA, MuSiQue and custom data;
  :func:`~nemo_jq.data.answers.finqa_number_match` for FinQA's numbers);
* evaluation: the paper's substring match, by token: the normalised y* (or, for MuSiQue, any
  alias) is a contiguous run of the normalised output's tokens; for FinQA, any number in the
  output passes the number rule; an output the training reward pays is correct too.

Formats: **cold** is the linearised x* alone (no task description, no formatting hint);
**warm** adds a system message with the task and the answer format. Both go through the
tokenizer's chat template with thinking on.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from nemo_jq.data.answers import (
    extract_final_answer,
    finqa_answer_match,
    finqa_normalize,
    finqa_output_match,
    finqa_reference,
    squad_normalize,
    text_exact_match,
    token_substring_match,
)
from nemo_jq.data.base import Example, check_format
from nemo_jq.registry import Registry


class BadRow(ValueError):
    """A source record that cannot become an example; the message says why."""


#: The QA datasets by name (``data.name``, ``nemo-jq data prepare --dataset``): ``@register_dataset(name)`` on a
#: :class:`QATask` subclass adds one (docs/extending.md).
DATASETS = Registry("dataset", reserved=("synthetic",))


def register_dataset(name: str) -> Callable[[type[QATask]], type[QATask]]:
    """``@register_dataset(name)``: the class's ``name`` must be ``name``, which a prepared folder's manifest records
    and training looks the dataset up by."""
    def decorate(cls: type[QATask]) -> type[QATask]:
        if getattr(cls, "name", name) != name:
            raise ValueError(f"dataset class {cls.__name__}, registered as {name!r}, has name {cls.name!r}: give it "
                             f"`name: str = {name!r}` (a prepared folder's manifest records it)")
        return DATASETS.register(name)(cls)

    return decorate


def required_field(record: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``record[key]``, of ``kind``; JSON's true and false are no numbers here (an answer ``True`` matches nothing)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if key not in record or record[key] is None:
        raise BadRow(f"missing field {key!r}")
    value = record[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise BadRow(f"field {key!r} must be {'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    return value


def required_text(record: dict[str, Any], key: str) -> str:
    """A string field, stripped; an empty one, or one without a letter or digit (``???``, a zero-width space), is a
    bad row (a prompt without its question asks nothing)."""
    text = required_field(record, key, str).strip()
    if not text:
        raise BadRow(f"empty {key!r}")
    if not any(character.isalnum() for character in text):
        raise BadRow(f"{key!r} {text!r} has no letter or digit: it asks nothing")
    return text


def answer_text(answer: str | int | float, key: str) -> str:
    """An answer field as text: a number as the JSON wrote it (``3.10``, not ``3.1``: its last digit is the answer's
    precision, which a numeric reward reads), a typed column's whole number as one."""
    if isinstance(answer, float):
        written = getattr(answer, "written", None) or (str(int(answer)) if answer.is_integer() else repr(answer))
        if not math.isfinite(answer) or "e" in written.lower():
            # NaN and Infinity are no JSON; 1e20 is not how an answer is written out
            raise BadRow(f"{key!r} is the number {written}, which no answer is written as: give it as a string")
        answer = written
    return str(answer).strip()


def required_answer(record: dict[str, Any], key: str = "answer") -> str:
    answer = answer_text(required_field(record, key, (str, int, float)), key)
    if not answer:
        raise BadRow(f"empty {key!r}")
    if not squad_normalize(answer):
        raise BadRow(f"{key!r} {answer!r} is empty once normalised (only punctuation): no output could match it")
    return answer


def record_id(record: Any, fallback: str) -> str:
    """The row's ``id`` (or ``_id``): a non-empty string or a whole number; else ``fallback`` (an empty id, or
    ``true``, named no row in a warning or a report)."""
    if isinstance(record, dict):
        for key in ("id", "_id"):
            value = record.get(key)
            if (isinstance(value, str) and value.strip()) or (isinstance(value, int) and not isinstance(value, bool)):
                return str(value)
    return fallback


@dataclass
class QATask:
    """Shared formatting and SQuAD-style scoring; subclasses parse their schema."""

    name: str = "qa"
    #: Character cap on the linearised input (the paper's subset rule); None = no cap.
    max_input_chars: int | None = None
    #: Whether a source that is no local file or folder names a Hugging Face hub dataset.
    from_hub: ClassVar[bool] = True
    #: The keys a row's object is read for, which ``data prepare`` names any other key beside (a misspelt ``Context``
    #: left every prompt without its passage, silently); None: rows carry fields of their own (a hub dataset's).
    read_keys: ClassVar[tuple[str, ...] | None] = None
    warm_system: str = "Answer the question. Think step by step, then reply with only the final answer."
    #: Which source split each of our splits is drawn from (validation and test draws are disjoint).
    source_splits: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("train", ("train",)),
        ("validation", ("validation", "dev")),
        ("test", ("validation", "dev")),
    )

    def parse(self, record: Any) -> Example:
        """One source record as an :class:`Example`; raises :class:`BadRow` saying what is wrong."""
        if not isinstance(record, dict):
            raise BadRow(f"record must be an object, got {type(record).__name__}")
        return self.build(record)

    def build(self, record: dict[str, Any]) -> Example:
        raise NotImplementedError

    def linearize(self, example: Example) -> str:
        """x* as one string: the context (if any), then the question."""
        return f"{example.context}\n\nQuestion: {example.question}" if example.context else example.question

    def empty_fields(self, example: Example) -> list[str]:
        """Fields the prompt uses that ``example`` leaves empty (none here: the prompt is built around them)."""
        del example
        return []

    def messages(self, example: Example, prompt_format: str) -> list[dict[str, str]]:
        user = {"role": "user", "content": self.linearize(example)}
        if check_format(prompt_format) == "cold":
            return [user]
        return [{"role": "system", "content": self.warm_system}, user]

    def extract_answer(self, output: str) -> str:
        return extract_final_answer(output)

    def corpus(self, examples: list[Example]) -> list[str]:
        return [self.warm_system] + [f"{self.linearize(e)}\n\n{e.answer}" for e in examples[:2000]]

    def normalize(self, text: str) -> str:
        return squad_normalize(text)

    def references(self, example: Example) -> tuple[str, ...]:
        return (example.answer,)

    def reward(self, output: str, example: Example) -> float:
        return float(text_exact_match(self.extract_answer(output), self.references(example)))

    def is_correct(self, output: str, example: Example) -> bool:
        """The paper's match (:meth:`found_in`), or the reward's: an answer the reward pays (``\\boxed{Paris}``, whose
        normalisation is the one word ``boxedparis``) counts as correct too."""
        return self.found_in(output, example) or self.reward(output, example) == 1.0

    def found_in(self, output: str, example: Example) -> bool:
        """The paper's substring match, by token."""
        return token_substring_match(output, self.references(example))


@register_dataset("hotpotqa")
@dataclass
class HotPotQA(QATask):
    """``hotpotqa/hotpot_qa`` (distractor): HF column-list context or the raw ``[[title, sentences]]`` form."""

    name: str = "hotpotqa"
    max_input_chars: int | None = 4000
    warm_system: str = (
        "Answer the question using the Wikipedia paragraphs. Think step by step, then reply with only "
        "the answer: a short span from the paragraphs, or yes or no."
    )

    def build(self, record: dict[str, Any]) -> Example:
        context = required_field(record, "context", (dict, list))
        if isinstance(context, dict):  # HF columns: {"title": [...], "sentences": [[...], ...]}
            titles, sentences = required_field(context, "title", list), required_field(context, "sentences", list)
            if len(titles) != len(sentences):
                raise BadRow("context.title and context.sentences differ in length")
            pairs = list(zip(titles, sentences))
        else:  # raw: [[title, [sentences]], ...]
            if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in context):
                raise BadRow("context must be a list of [title, sentences] pairs")
            pairs = [tuple(p) for p in context]
        for title, sents in pairs:
            if not isinstance(title, str) or not isinstance(sents, list) or not all(isinstance(s, str) for s in sents):
                raise BadRow("each context paragraph needs a title string and a list of sentence strings")
        paragraphs = "\n\n".join(f"{title}\n{''.join(sents).strip()}" for title, sents in pairs)
        return Example(
            id=record_id(record, ""),
            question=required_text(record, "question"),
            answer=required_answer(record),
            context=paragraphs,
        )


@register_dataset("musique")
@dataclass
class MuSiQue(QATask):
    """``bdsaglam/musique``: 20 titled paragraphs, ``answer`` and ``answer_aliases`` (unanswerable rows are bad rows)."""

    name: str = "musique"
    max_input_chars: int | None = 10000
    #: The hub's split names, then the official release's files (musique_ans_v1.0_{train,dev}.jsonl).
    source_splits: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("train", ("train", "musique_ans_v1.0_train")),
        ("validation", ("validation", "dev", "musique_ans_v1.0_dev")),
        ("test", ("validation", "dev", "musique_ans_v1.0_dev")),
    )
    warm_system: str = (
        "Answer the multi-hop question using the paragraphs; it needs facts from several of them. "
        "Think step by step, then reply with only the short answer."
    )

    def build(self, record: dict[str, Any]) -> Example:
        if record.get("answerable") is False:
            raise BadRow("unanswerable question (answerable=false)")
        paragraphs = required_field(record, "paragraphs", list)
        texts = []
        for p in paragraphs:
            if not isinstance(p, dict) or not isinstance(p.get("title"), str) or not isinstance(p.get("paragraph_text"), str):
                raise BadRow("each paragraph needs string 'title' and 'paragraph_text'")
            texts.append(f"{p['title']}\n{p['paragraph_text'].strip()}")
        aliases = record.get("answer_aliases") or []
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise BadRow("field 'answer_aliases' must be a list of strings")
        return Example(
            id=record_id(record, ""),
            question=required_text(record, "question"),
            answer=required_answer(record),
            context="\n\n".join(texts),
            aliases=tuple(a.strip() for a in aliases if a.strip()),
        )

    def references(self, example: Example) -> tuple[str, ...]:
        return (example.answer, *example.aliases)


@register_dataset("finqa")
@dataclass
class FinQA(QATask):
    """FinQA's raw ``train/dev/test.json``: ``pre_text``, ``table``, ``post_text``, ``qa{question, answer, exe_ans}``.

    A row whose ``qa.answer`` is empty is valid when its program's ``exe_ans`` is set (FinQA's own
    evaluation scores against ``exe_ans``): y* is then :func:`~nemo_jq.data.answers.finqa_reference`
    of it, and ``meta["reference_source"]`` says ``"exe_ans"``.
    """

    name: str = "finqa"
    max_input_chars: int | None = 8000
    #: Its hub entry is a script dataset current ``datasets`` no longer runs (docs/datasets.md): a missing
    #: ``data/finqa`` is said at once, not looked up on the hub for ~25 s of retries.
    from_hub: ClassVar[bool] = False
    warm_system: str = (
        "Answer the question about the financial report excerpt (text and table). Think step by step, "
        "then reply with only the final answer: a number (write percentages with %), or yes or no."
    )
    source_splits: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("train", ("train",)),
        ("validation", ("dev", "validation")),
        ("test", ("test",)),
    )

    def build(self, record: dict[str, Any]) -> Example:
        pre = required_field(record, "pre_text", list)
        post = required_field(record, "post_text", list)
        table = required_field(record, "table", list)
        qa = required_field(record, "qa", dict)
        if not all(isinstance(s, str) for s in pre + post):
            raise BadRow("pre_text and post_text must be lists of strings")
        if not all(isinstance(row, list) for row in table):
            raise BadRow("table must be a list of rows")
        rows = "\n".join(" | ".join(str(cell).strip() for cell in row) for row in table)
        context = "\n".join([" ".join(s.strip() for s in pre), rows, " ".join(s.strip() for s in post)]).strip()
        executed = qa.get("exe_ans")
        annotated = answer_text(required_field(qa, "answer", (str, int, float)), "qa.answer")
        answer = finqa_reference(annotated, executed)
        if not answer:
            raise BadRow(f"empty 'answer' and no usable 'exe_ans' (got {executed!r})")
        return Example(
            id=record_id(record, ""),
            question=required_text(qa, "question"),
            answer=answer,
            context=context,
            meta={"exe_ans": executed, "program": qa.get("program"),
                  "reference_source": "answer" if annotated else "exe_ans"},
        )

    def normalize(self, text: str) -> str:
        return finqa_normalize(text)

    def reward(self, output: str, example: Example) -> float:
        return float(finqa_answer_match(self.extract_answer(output), example.answer, example.meta.get("exe_ans")))

    def found_in(self, output: str, example: Example) -> bool:
        """Any number written in the output passes the number rule (yes/no: by token)."""
        return finqa_output_match(output, example.answer, example.meta.get("exe_ans"))


#: The custom dataset's user turn: the context (when the row has one), then the question.
DEFAULT_TEMPLATE = "{context}\n\nQuestion: {question}"


@register_dataset("jsonl")
@dataclass
class CustomQA(QATask):
    """Your own JSONL with ``question`` and ``answer`` (optional ``context``, ``id``) and a prompt template.

    ``template`` is a ``str.format`` pattern over ``question`` and ``context`` for the user turn;
    ``system`` is the warm-format system message.
    """

    name: str = "jsonl"
    #: Your own data's cap: a longer prompt is dropped and named at prepare time (32,000 characters is about 8,000
    #: tokens, within Qwen3's 40,960-token context with room for a thinking budget); a training run then checks
    #: every prompt, in tokens, against the model's own context.
    max_input_chars: int | None = 32000
    #: Your own data is local: a missing file is said at once, not looked up on the hub.
    from_hub: ClassVar[bool] = False
    read_keys: ClassVar[tuple[str, ...] | None] = ("question", "answer", "context", "id", "_id")
    template: str = DEFAULT_TEMPLATE
    system: str = "Answer the question. Think step by step, then reply with only the final answer."

    def __post_init__(self) -> None:
        try:
            fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(self.template)
                      if name is not None]
        except ValueError as err:
            raise ValueError(f"prompt template {self.template!r} may only use {{question}} and {{context}} (a brace of "
                             f"its own written {{{{ or }}}}): {err}") from None
        odd = next((field for field in fields if field[0] not in ("question", "context") or field[1] or field[2]), None)
        if odd is not None:  # an attribute, an index, a format spec or a conversion: {context.__class__} formats
            name, spec, conversion = odd
            written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"prompt template {self.template!r} may only use {{question}} and {{context}} as they are "
                             f"(a brace of its own written {{{{ or }}}}); got {written}")
        if not any(name == "question" for name, _, _ in fields):  # every prompt would be the same
            raise ValueError(f"prompt template {self.template!r} does not use {{question}}: every prompt would be the "
                             "same; put {question} where the question goes")
        self.warm_system = self.system

    def build(self, record: dict[str, Any]) -> Example:
        context = "" if record.get("context") is None else record["context"]  # null: none (a data frame's missing one)
        if not isinstance(context, str):
            raise BadRow(f"field 'context' must be str, got {type(context).__name__}")
        return Example(
            id=record_id(record, ""),
            question=required_text(record, "question"),
            answer=required_answer(record),
            context=context.strip(),
        )

    def linearize(self, example: Example) -> str:
        return self.template.format(question=example.question, context=example.context).strip()

    def empty_fields(self, example: Example) -> list[str]:
        """The fields a custom template uses that ``example`` leaves empty (its prompt holds them blank; the default
        template's context stands first, so a row without one is a plain question)."""
        if self.template == DEFAULT_TEMPLATE:
            return []
        used = {name for _, name, _, _ in string.Formatter().parse(self.template) if name}
        return [name for name in ("question", "context") if name in used and not getattr(example, name)]



#: Hub names the paper uses, with their configs (FinQA's hub entry is a script dataset that current
#: ``datasets`` no longer runs: use its raw JSON files).
HUB_SOURCES = {"hotpotqa": ("hotpotqa/hotpot_qa", "distractor"), "musique": ("bdsaglam/musique", None)}


def describe_datasets() -> str:
    """Each registered dataset: what its records hold, and the files a --source folder is searched for."""
    from nemo_jq.data.sources import SUFFIXES, folder_split_names

    lines = []
    for name in sorted(DATASETS):
        task = DATASETS[name]
        doc = " ".join((task.__doc__ or "").split("\n\n")[0].split()).replace("``", "")
        files = "; ".join(f"{target}: {' or '.join(folder_split_names(target, names))}"
                          for target, names in dict(task.source_splits).items())
        cap = f"; inputs of {task.max_input_chars} characters or more are dropped" if task.max_input_chars else ""
        lines.append(f"  {name}: {doc}\n    a --source folder is searched for {files} ({'/'.join(SUFFIXES)}){cap}")
    return "\n".join(lines)
