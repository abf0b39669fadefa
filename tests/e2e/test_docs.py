"""Every command and code block a user reads (README.md and docs/) either runs in the suite or says, in a marker line
right before its fence, what it needs that the suite lacks: a reader can tell the checked examples from the rest, and
a new example is one or the other (docs/extending.md's rollout-engine example once failed as written: nothing ran it).
"""

import re
from pathlib import Path

import doc_pages

ROOT = doc_pages.ROOT

#: The fences that hold a command or a program (yaml, plain text and program output are neither).
CODE_FENCE = re.compile(r"^```(bash|sh|shell|console|python|py)\s*$")

#: What a block may need instead of running here; or `not run: <why>`.
MARKER = re.compile(r"^<!-- (needs: (GPU|cluster|network|Docker)\b.*|not run: \S.*) -->$")

#: (page, a line only that block of the page holds: its first where that is unique) -> the test that runs the block.
RUN_BY = {
    # The suite itself: .ci/run runs it, and this test holds README's copy to .ci/run's.
    ("README.md", "python -m pytest -q"): "test_readme_commands_match_ci",
    ("README.md", "import torch"): "test_readme_python_example_runs_verbatim",
    ("docs/cluster.md", "#SBATCH --requeue"): "test_every_sbatch_launcher_requeues_on_the_requeue_exit_code_from_the_host",
    ("docs/moe.md", "nemo-jq plan --config configs/examples/qwen3_30b_a3b_hotpotqa_cold_garl_q0.75.yaml --nodes 8   "
                    "# TP=2 PP=1 DP=32 EP=8 (67.05 of 72 GiB)"):
        "test_the_readmes_plan_commands_say_what_they_print",
    ("docs/cluster.md", "nemo-jq plan --model 32b --nodes 16 --seq-len 4608 --samples 16 --micro-batch 4 "
                        "--optimizer bf16-distopt \\"): "test_the_readmes_plan_commands_say_what_they_print",
    ("docs/cluster.md", "nemo-jq plan --config configs/qwen3_0p6b/hotpotqa_cold_garl_q0.25.yaml --gpus-per-node 1   "
                        "# the run: at least 60.7 h, expected 171.0 h"): "test_the_readmes_plan_commands_say_what_they_print",
    ("docs/estimators.md", "nemo-jq train objective.name=garl_score_only objective.q=0.75 train.run_dir=runs/garl_score_only"):
        "test_each_doc_command_trains_two_steps",  # on the tiny run, two steps
    ("docs/training.md", "nemo-jq train train.run_dir=runs/sft_then_rlvr objective.name=garl "
                         "objective.q_schedule=configs/schedules/sft_then_rlvr.yaml"):
        "test_the_documented_command_trains",  # on the tiny run, two steps
    ("docs/off_policy_rollouts.md", "nemo-jq train train.run_dir=runs/trusted objective.importance=none  # trust the "
                                    "engine: no correction"):
        "test_the_documented_command_trains",  # on the tiny run, two steps; the vLLM line's engine in test_vllm.py
    ("docs/extending.md", "class ScaledOptions:"): "test_a_one_file_estimator_in_a_package_trains_through_nemo_jq_train",
    ("docs/extending.md", "class Trivia(QATask):"): "test_the_documented_dataset_prepares_through_a_plugin",
    ("docs/extending.md", "class Halving(StepOnlyQ):"): "test_a_q_schedule_of_ones_own_registered_in_a_plugin_sets_each_steps_q",
    ("docs/extending.md", "class UniformSampler:"): "test_the_documented_rollout_engine_trains_and_is_refitted_after_every_step",
    ("docs/sweeps.md", "nemo-jq sweep --resume runs/q_sweep"):
        "test_the_documented_sweep_stopped_resumes_to_an_unstopped_ones_metrics_and_its_report_reads_each_runs_results",
    ("docs/sweeps.md", 'nemo-jq generate runs/cold_start/garl_q1 "3+4+5" --answer 12 --samples 4'):
        "test_the_documented_sweep_stopped_resumes_to_an_unstopped_ones_metrics_and_its_report_reads_each_runs_results",
    ("docs/rollout_ranks.md", "torchrun --nproc-per-node 2 -m nemo_jq.cli train rollout.placement=separate "
                              "rollout.async_steps=1 train.run_dir=runs/separate"):
        "test_the_documented_torchrun_command_trains_one_step_off_on_a_rollout_rank",  # on the tiny run, two steps
}


def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """Each command or program block of a page: the fence's line number, the line before it, the block's lines."""
    lines, blocks, number = text.splitlines(), [], 0
    while number < len(lines):
        if lines[number].startswith("```"):
            end = next((i for i in range(number + 1, len(lines)) if lines[i].startswith("```")), len(lines))
            if CODE_FENCE.match(lines[number]):
                blocks.append((number + 1, lines[number - 1] if number else "", lines[number + 1:end]))
            number = end
        number += 1
    return blocks


def defined_tests(tests: Path) -> dict[str, str]:
    """Each test function's name under ``tests``, and the text of the file that defines it."""
    found = {}
    for path in tests.rglob("test_*.py"):
        source = path.read_text()
        for name in re.findall(r"^def (test_\w+)\(", source, flags=re.M):
            found[name] = source
    return found


def unaccounted(pages: dict[str, str], run_by: dict[tuple[str, str], str], tests: dict[str, str]) -> list[str]:
    """What breaks the rule: a block neither run nor marked (or both), a marker that says nothing, a registry entry
    that names no single block, or a test that does not exist or never reads the page."""
    problems, claimed = [], set()
    for (page, line), test in run_by.items():
        holders = [number for number, _, block in code_blocks(pages.get(page, "")) if line in block]
        if len(holders) != 1:
            problems.append(f"{page}: {len(holders)} blocks hold {line!r} (the registry names one)")
        elif test not in tests:
            problems.append(f"{page}:{holders[0]}: the test that runs it, {test}, does not exist")
        elif Path(page).name not in tests[test] and "doc_pages" not in tests[test]:
            problems.append(f"{page}:{holders[0]}: {test}'s file never reads {page}")
        else:
            claimed.add((page, holders[0]))
    for page, text in pages.items():
        for number, before, _ in code_blocks(text):
            marked = before.startswith("<!--")
            if marked and not MARKER.match(before):
                problems.append(f"{page}:{number}: {before!r} is not a marker: <!-- needs: GPU|cluster|network|Docker "
                                "... --> or <!-- not run: <why> -->")
            elif marked and (page, number) in claimed:
                problems.append(f"{page}:{number}: marked as not run, but {page} is in RUN_BY")
            elif not marked and (page, number) not in claimed:
                problems.append(f"{page}:{number}: neither run by a test (RUN_BY in tests/e2e/test_docs.py) nor marked by "
                                "a line before its fence (<!-- needs: GPU --> or <!-- not run: <why> -->)")
    return problems


def repository_pages() -> dict[str, str]:
    return {str(page.relative_to(ROOT)): page.read_text() for page in doc_pages.pages()}


def test_every_block_runs_in_the_suite_or_says_what_it_needs():
    assert unaccounted(repository_pages(), RUN_BY, defined_tests(ROOT / "tests")) == []


def test_the_check_names_each_way_a_block_can_go_unaccounted():
    page = "\n".join(["Run it:", "```bash", "nemo-jq train", "```", "<!-- needs: luck -->", "```python", "print(1)",
                      "```", "<!-- needs: GPU -->", "```bash", "nemo-jq plan", "```", "```yaml", "a: 1", "```", ""])
    tests = {"test_plan_runs": "read docs/page.md", "test_elsewhere": "reads nothing"}
    problems = unaccounted({"docs/page.md": page}, {("docs/page.md", "nemo-jq plan"): "test_plan_runs",
                                                    ("docs/page.md", "gone"): "test_plan_runs",
                                                    ("docs/other.md", "x"): "test_elsewhere"}, tests)
    assert problems == [
        "docs/page.md: 0 blocks hold 'gone' (the registry names one)",
        "docs/other.md: 0 blocks hold 'x' (the registry names one)",
        "docs/page.md:2: neither run by a test (RUN_BY in tests/e2e/test_docs.py) nor marked by a line before its fence "
        "(<!-- needs: GPU --> or <!-- not run: <why> -->)",
        "docs/page.md:6: '<!-- needs: luck -->' is not a marker: <!-- needs: GPU|cluster|network|Docker ... --> or "
        "<!-- not run: <why> -->",
        "docs/page.md:10: marked as not run, but docs/page.md is in RUN_BY",
    ]
    bare = page.replace("<!-- needs: GPU -->\n", "")
    assert unaccounted({"docs/page.md": bare}, {("docs/page.md", "nemo-jq plan"): "test_missing"}, tests)[0] == (
        "docs/page.md:9: the test that runs it, test_missing, does not exist")
    assert unaccounted({"docs/page.md": bare}, {("docs/page.md", "nemo-jq plan"): "test_elsewhere"}, tests)[0] == (
        "docs/page.md:9: test_elsewhere's file never reads docs/page.md")
