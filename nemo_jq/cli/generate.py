"""``nemo-jq generate``: what a run's checkpoint writes for a question, in the run's chat format and thinking budget."""

from __future__ import annotations

import argparse
import json

from nemo_jq.cli import arguments


def add_parser(commands) -> None:
    generate = commands.add_parser(
        "generate", help="sample a checkpoint's rationales and answers for a question",
        description='nemo-jq generate runs/cold_start/garl_q1 "3+4+5" --samples 4\n\n'
                    "The prompt is the run's (its task's messages in data.format, its chat template), the budgets its\n"
                    "rollout.max_thinking_tokens and max_answer_tokens (overrides change them); --answer gives the\n"
                    "reference answer, so each sample is scored by the task's rule, as training rewards it.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    generate.add_argument("checkpoint", type=arguments.path, help="a run directory (its best checkpoint) or a checkpoint directory")
    generate.add_argument("question", help="the question, as the run's task states its questions")
    generate.add_argument("--context", default="", help="the passage a question is asked about (HotPotQA, MuSiQue, FinQA)")
    generate.add_argument("--answer", help="the reference answer: each sample is then marked correct or not")
    generate.add_argument("--samples", type=arguments.positive, default=1, help="samples to draw (default 1)")
    generate.add_argument("--greedy", action="store_true", help="argmax decoding instead of the run's sampling")
    generate.add_argument("--seed", type=arguments.seed, default=0)
    generate.add_argument("--step", default="best", help=arguments.STEP_HELP)
    generate.add_argument("--json", action="store_true", help="print JSON instead of text")
    generate.add_argument("overrides", nargs="*", default=[], help="how it samples and where it runs, e.g. rollout.max_thinking_tokens=512")
    generate.set_defaults(run=run)


def is_override(word: str) -> bool:
    """Whether ``word`` is a ``section.key=value`` override of a config section (or ``plugins=``)."""
    import dataclasses

    from nemo_jq.cli import OVERRIDE_WORD
    from nemo_jq.config import Config

    return bool(OVERRIDE_WORD.match(word)) and word.split(".", 1)[0].split("=", 1)[0] in {
        field.name for field in dataclasses.fields(Config)}


def run(args: argparse.Namespace) -> int:
    from nemo_jq.cli.evaluate import load
    from nemo_jq.data import Example
    from nemo_jq.models.common import new_generator
    from nemo_jq.recipe.components import check_prompt_lengths, resolve_model_dir
    from nemo_jq.recipe.evaluation import shown_samples

    if not args.question.strip():
        raise ValueError("the question is empty: give it as the run's task states its questions, e.g. "
                         'nemo-jq generate RUN_DIR "3+4+5" (as the synthetic task states them)')
    if is_override(args.question):  # the question left out: the first override took its place, and was sampled
        raise ValueError(f"the question is missing ({args.question} is an override): give it before the overrides, "
                         f'e.g. nemo-jq generate {args.checkpoint} "3+4+5" {" ".join([args.question, *args.overrides])}')
    answer = "" if args.answer is None else reference_answer(args.answer)
    loaded = load(args)
    parts, selected = loaded.components, loaded.selected
    example = Example("generate", args.question, answer, context=args.context)
    if args.context and parts.prompt_ids([example]) == parts.prompt_ids([Example("generate", args.question, answer)]):
        raise ValueError(f"--context: this run's task (data.name={parts.config.data.name}) puts no passage in its "
                         "prompts, so the model would never see it: drop --context")
    check_prompt_lengths(parts.config, resolve_model_dir(parts.config.model.path), parts.task, parts.chat,
                         [("the question", example)],
                         "shorten the question (or --context), or lower rollout.max_thinking_tokens")
    generator = new_generator(parts.device).manual_seed(args.seed)
    [group] = parts.engine.generate(parts.prompt_ids([example]), args.samples, sample_answers=True, generator=generator,
                                    greedy=args.greedy, routes=False)
    [shown] = shown_samples(parts, [example], [group], limit=args.samples)
    if args.answer is None:
        for sample in shown["samples"]:
            del sample["correct"]
    if args.json:
        print(json.dumps({**selected.describe(), **shown}, indent=2))
        return 0
    print(f"step {selected.step} of {selected.run_dir} ({selected.why})")
    for index, sample in enumerate(shown["samples"], 1):
        forced = " (budget reached: </think> forced)" if sample["think_end_forced"] else ""
        verdict = "" if "correct" not in sample else f" [{'correct' if sample['correct'] else 'wrong'}]"
        print(f"--- sample {index}\n<think>{sample['rationale']}</think>{forced}\nanswer: {sample['answer']}{verdict}")
    return 0


def reference_answer(answer: str) -> str:
    """``--answer`` as ``data prepare`` keeps a row's answer: one no output could match (empty, only punctuation or
    articles) would mark every sample wrong, so it is refused."""
    from nemo_jq.data.qa import BadRow, required_answer

    try:
        return required_answer({"--answer": answer}, "--answer")
    except BadRow as err:
        raise ValueError(f"{err}: give the reference answer as the run's data states it, or leave --answer out to see "
                         "the samples unscored") from None
