"""Package-level promises: a light import, the theory command, and the README example."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code_or_args, **kwargs):
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, cwd=ROOT, timeout=300, **kwargs)


def test_objectives_import_pulls_no_backend():
    code = (
        "import nemo_jq, nemo_jq.objectives, sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers','megatron','datasets')))"
    )
    result = _run(["-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_theory_command_writes_tables_json_and_plot(tmp_path):
    result = _run(["-m", "nemo_jq.cli", "theory", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    assert "Escape time T_q(p0, 1/2)" in result.stdout and "Thm 4.1" in result.stdout
    report = json.loads((tmp_path / "theory.json").read_text())
    assert {row["q"] for row in report["escape_time"]} == {0.0, 0.25, 0.5, 0.75, 1.0}
    for row in report["escape_time"]:
        assert abs(row["ode"] / row["quadrature"] - 1) < 1e-6
    png = (tmp_path / "escape_time.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_readme_python_example_runs_verbatim():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "README has no python example"
    result = _run(["-c", blocks[0]])
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 3
    losses = [float(line.split("l_q")[1].split()[0]) for line in lines]
    assert losses[-1] < losses[0]  # the example actually trains


def test_readme_commands_match_ci():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    test_command = re.search(r"Run the tests.*?```bash\n(.*?)\n```", readme, flags=re.S).group(1).strip()
    assert test_command in ci.splitlines()


def test_the_tree_is_lint_clean():
    """ruff, configured in pyproject.toml (line length, import order, unused code), finds nothing."""
    result = _run(["-m", "ruff", "check", "--no-cache", "."])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_docs_links_lead_somewhere():
    """Every relative link in README.md and docs/ names a file that exists, and every #anchor a heading of its page."""
    import doc_pages

    broken = []
    for page in doc_pages.pages():
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL: not reachable from here
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_version_is_the_packages_own():
    """``nemo_jq.__version__`` is read from the installed package's metadata (it once said 0.1.0 beside a 0.2.0)."""
    import tomllib

    import nemo_jq

    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert nemo_jq.__version__ == declared
