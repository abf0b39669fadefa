"""CI's check of the demo (``.ci/check_demo_readme.py``): what holds on every machine, always; the exact table only on a
machine kind docs/results/demo.md records one for (issue 45: an AVX-512 machine computed another table than README.md's
AVX2 one, and CI failed there until the table was swapped). Here on demo outputs made up to hold, or break, each
invariant (the real demo runs in .ci/run, a few minutes)."""

import importlib.util
import json
from pathlib import Path

import pytest

from nemo_jq.recipe.demo import DEMO_RUNS, markdown_table

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_demo_readme", ROOT / ".ci" / "check_demo_readme.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

#: A demo's outcome as the invariants want it: (test p@1, p@16, m@16), best step, escape step, final log P̂.
HOLDING = {"grpo": ((0.5, 6.2, 0.8), 448, None, None), "garl_q0": ((4.7, 4.7, 4.7), 64, 20, -33.0),
           "garl_q0.5": ((15.0, 69.5, 22.7), 704, 15, -4.8), "garl_q0.75": ((18.4, 90.6, 20.3), 768, 14, -2.2),
           "garl_q1": ((23.4, 89.8, 32.8), 704, 10, -1.6)}


def make_demo(folder: Path, outcome: dict) -> Path:
    summary = {}
    for label, slug, _ in DEMO_RUNS:
        (p1, p16, m16), best, escape, final = outcome[slug]
        summary[label] = {"best_step": best, "test": {"p@1": p1, "p@16": p16, "m@16": m16},
                          "initial_log_p_hat": None if slug == "grpo" else -22.396}
        (folder / slug).mkdir(parents=True)
        records = [{"kind": "train", "step": step, "log_p_hat": None if escape is None else
                    (-22.4 if step < escape else final)} for step in range(1, 101)]
        (folder / slug / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder / "summary.json"


def docs_recording(tmp_path: Path, tables: dict[str, str], readme_kind: str) -> tuple[Path, Path]:
    demo_md = tmp_path / "demo.md"
    demo_md.write_text("# demo\n\n" + "".join(
        f"### {kind}{check.README_MARK if kind == readme_kind else ''}\n\n{table}\n\n" for kind, table in tables.items()))
    readme = tmp_path / "README.md"
    readme.write_text(f"text\n\n{tables[readme_kind]}\n\nmore\n")
    return demo_md, readme


def run(monkeypatch, summary: Path, readme: Path, demo_md: Path, kind: str) -> int:
    monkeypatch.setattr(check, "machine_kind", lambda: kind)
    return check.main(str(summary), str(readme), str(demo_md))


def test_the_repository_s_records_parse_and_the_readme_holds_its_machine_s_table():
    tables, readme_kind = check.recorded_tables((ROOT / "docs" / "results" / "demo.md").read_text())
    assert readme_kind == "AMD EPYC, AVX2" and len(tables) >= 2
    assert tables[readme_kind] in (ROOT / "README.md").read_text()
    assert check.machine_kind().count(",") == 1


def test_a_machine_kind_with_a_recorded_table_is_held_to_it_and_any_other_to_what_holds_everywhere(tmp_path, monkeypatch,
                                                                                                     capsys):
    summary = make_demo(tmp_path / "demo", HOLDING)
    ours = markdown_table(json.loads(summary.read_text()))
    other = ours.replace("| 23.4 |", "| 46.5 |")
    demo_md, readme = docs_recording(tmp_path, {"AMD EPYC, AVX2": other, "Intel(R) Xeon(R), AVX512": ours}, "AMD EPYC, AVX2")
    assert run(monkeypatch, summary, readme, demo_md, "Intel(R) Xeon(R), AVX512") == 0
    assert run(monkeypatch, summary, readme, demo_md, "AMD EPYC, AVX2") == 1
    assert "another table than" in capsys.readouterr().out
    assert run(monkeypatch, summary, readme, demo_md, "AMD EPYC, AVX512") == 0
    assert "### AMD EPYC, AVX512" in capsys.readouterr().out  # how to record it
    readme.write_text(ours)  # the README's table must be the one recorded as README's
    assert run(monkeypatch, summary, readme, demo_md, "Intel(R) Xeon(R), AVX512") == 1


@pytest.mark.parametrize("broken,message", [
    ({"grpo": ((3.0, 9.0, 3.5), 448, None, None)}, "GRPO should stay at chance"),
    ({"garl_q0.5": ((15.0, 69.5, 22.7), 704, 60, -4.8)}, "GARL q=0.5 should escape"),
    ({"garl_q1": ((23.4, 89.8, 32.8), 704, 16, -1.6)}, "the higher q should escape no later"),
    ({"garl_q0.75": ((0.5, 5.0, 0.8), 768, 14, -2.2)}, "should end above GRPO"),
    ({"garl_q0": ((4.7, 4.7, 4.7), 512, 20, -33.0)}, "GARL q=0 should collapse"),
    ({"garl_q0": ((4.7, 4.7, 4.7), 64, 20, -8.0)}, "GARL q=0 should collapse"),
])
def test_what_holds_on_every_machine_is_checked_on_every_machine(tmp_path, monkeypatch, capsys, broken, message):
    summary = make_demo(tmp_path / "demo", {**HOLDING, **broken})
    table = markdown_table(json.loads(summary.read_text()))
    demo_md, readme = docs_recording(tmp_path, {"AMD EPYC, AVX2": table}, "AMD EPYC, AVX2")
    assert run(monkeypatch, summary, readme, demo_md, "AMD EPYC, AVX2") == 1  # even with its table recorded
    assert message in capsys.readouterr().out
