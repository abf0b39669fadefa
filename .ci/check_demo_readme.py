"""Check the demo that just ran: what holds on every machine, and its exact table where one is recorded for this kind.

The demo is deterministic on a given machine kind, but float rounding differs between CPUs' kernels and one seed's
trajectory past the escape follows it (docs/results/demo.md), so the exact table depends on the machine kind: its CPU
family and the kernels torch picks on it (``torch.backends.cpu.get_cpu_capability()``). Checked always, from the
demo's summary.json and each run's metrics.jsonl: GRPO stays at chance; every GARL run starts from the same log P̂;
GARL at q >= 0.5 escapes (log P̂ above -5) within 30 steps, no later the higher q, and ends above GRPO on test p@16;
GARL at q=0 collapses (its last 50 steps' log P̂ below -20) after an early best checkpoint (step 128 or before).
Checked where docs/results/demo.md records a table for this machine kind: the table, exactly; and README.md's table
is the one docs/results/demo.md says it is. Elsewhere the table is printed with how to record it.

Usage: python .ci/check_demo_readme.py SUMMARY_JSON README_MD [DEMO_MD]
"""

import json
import platform
import re
import sys
from pathlib import Path

import torch

from nemo_jq.recipe.demo import DEMO_RUNS, markdown_table

README_MARK = " (README.md's table)"


def machine_kind() -> str:
    """``"<CPU family>, <torch's CPU capability>"``, e.g. ``"AMD EPYC, AVX2"``."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor())
    return f"{' '.join(model.split()[:2])}, {torch.backends.cpu.get_cpu_capability()}"


def recorded_tables(demo_md: str) -> tuple[dict[str, str], str | None]:
    """The tables docs/results/demo.md records, by machine kind (its ``### <kind>`` headings), and README's kind."""
    tables, readme_kind = {}, None
    for match in re.finditer(r"^### (.+)\n\n((?:\|.*\n)+)", demo_md, flags=re.M):
        kind = match.group(1).strip()
        if kind.endswith(README_MARK):
            kind = readme_kind = kind.removesuffix(README_MARK)
        tables[kind] = match.group(2).strip()
    return tables, readme_kind


def invariants(summary: dict, run_dir: Path) -> list[str]:
    """What the demo shows on every machine; the failures, in words."""
    failures = []
    labels = {slug: label for label, slug, _ in DEMO_RUNS}

    def log_p_hat(slug: str) -> list[tuple[int, float]]:
        records = [json.loads(line) for line in (run_dir / slug / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["log_p_hat"]) for r in records if r["kind"] == "train" and r.get("log_p_hat") is not None]

    grpo = summary[labels["grpo"]]["test"]
    if grpo["p@1"] > 2 or grpo["m@16"] > 2:
        failures.append(f"GRPO should stay at chance (p@1 and m@16 at most 2); got {grpo}")
    starts = {round(summary[labels[slug]]["initial_log_p_hat"], 1) for slug in ("garl_q0", "garl_q0.5", "garl_q0.75", "garl_q1")}
    if len(starts) != 1:
        failures.append(f"every GARL run should start from the same log P̂; got {sorted(starts)}")
    escapes = {}
    for slug in ("garl_q0.5", "garl_q0.75", "garl_q1"):
        escapes[slug] = next((step for step, value in log_p_hat(slug) if value > -5), None)
        if escapes[slug] is None or escapes[slug] > 30:
            failures.append(f"{labels[slug]} should escape (log P̂ above -5) within 30 steps; it did at {escapes[slug]}")
        if summary[labels[slug]]["test"]["p@16"] <= grpo["p@16"]:
            failures.append(f"{labels[slug]} should end above GRPO on test p@16; got {summary[labels[slug]]['test']}")
    if None not in escapes.values() and not escapes["garl_q1"] <= escapes["garl_q0.75"] <= escapes["garl_q0.5"]:
        failures.append(f"the higher q should escape no later; escape steps {escapes}")
    last = [value for _, value in log_p_hat("garl_q0")[-50:]]
    best = summary[labels["garl_q0"]]["best_step"]
    if sum(last) / len(last) > -20 or best > 128:
        failures.append(f"GARL q=0 should collapse after an early best checkpoint; last 50 steps' log P̂ "
                        f"{sum(last) / len(last):.1f}, best step {best}")
    return failures


def main(summary_path: str, readme_path: str, demo_md_path: str = "docs/results/demo.md") -> int:
    summary = json.loads(Path(summary_path).read_text())
    table, kind = markdown_table(summary), machine_kind()
    failures = invariants(summary, Path(summary_path).parent)
    tables, readme_kind = recorded_tables(Path(demo_md_path).read_text())
    readme = Path(readme_path).read_text()
    if readme_kind is None or tables[readme_kind] not in readme:
        failures.append(f"README.md's demo table is not the one {demo_md_path} records as README.md's ({readme_kind})")
    if kind in tables and tables[kind] != table:
        failures.append(f"on this machine kind ({kind}) the demo wrote another table than {demo_md_path} records:\n"
                        f"recorded:\n{tables[kind]}\nthe demo wrote:\n{table}")
    for failure in failures:
        print(f"demo check: {failure}")
    if failures:
        return 1
    if kind in tables:
        print(f"demo: what holds on every machine holds, and the table is the one recorded for {kind}")
    else:
        print(f"demo: what holds on every machine holds; no table is recorded for this machine kind ({kind}), so the "
              f"exact table was not checked. To record it, add to {demo_md_path}:\n### {kind}\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
