"""Package-level promises: a light import, the theory command, and the README example."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code_or_args, **kwargs):
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, cwd=ROOT, timeout=300, **kwargs)


@pytest.mark.slow
def test_objectives_import_pulls_no_backend():
    code = (
        "import nemo_jq, nemo_jq.objectives, sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers','megatron','datasets')))"
    )
    result = _run(["-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_commands_help_imports_no_torch():
    """Every command's parser is built at each start: `nemo-jq --help` (and any command's) took 4-7 s, most of it
    torch, imported for the names of the off-policy corrections and two help listings made whether shown or not."""
    code = ("import sys\nfrom nemo_jq.cli import main\nfor words in (['--help'], ['report', '--help'], ['sweep', '--help']):\n"
            "    try:\n        main(words)\n    except SystemExit:\n        pass\nprint('torch' in sys.modules)")
    result = _run(["-c", code])
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "False", result.stderr


@pytest.mark.slow
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


@pytest.mark.slow
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

    declared = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]
    assert nemo_jq.__version__ == declared


def _imports_of(path: Path) -> set[str]:
    """The nemo_jq modules ``path`` imports, at the top or inside a function (the lazy imports count too)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] == "nemo_jq"}


def test_the_packages_import_in_layers():
    """The estimators and the theory stand alone (a user's own loop imports them); the run plumbing (runtime: the
    process world, checkpoints, run folders) stands under the models and engines that use it; the models and rollout
    engines never reach up into the recipe, the cluster tools, the command line or the backends that use them, and the
    rollout engines build on the models, not the models on them (nemo_jq/backends.py, above both, composes a policy with
    its engine); the recipe is under the commands, the cluster tools, the dry run and the experiments that run it."""
    forbidden = {("objectives", "theory"): ("recipe", "runtime", "cli", "cluster", "models", "rollouts", "dryrun", "backends"),
                 ("runtime",): ("models", "rollouts", "recipe", "cli", "cluster", "dryrun", "experiments", "backends"),
                 ("models", "rollouts"): ("recipe", "cli", "cluster", "dryrun", "experiments", "backends"),
                 ("models",): ("rollouts",),  # the engines build on the models' protocols, never the other way round
                 ("recipe",): ("cli", "cluster", "dryrun", "experiments")}
    crossings = []
    for packages, above in forbidden.items():
        for package in packages:
            for path in sorted((ROOT / "nemo_jq" / package).rglob("*.py")):
                crossings += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(_imports_of(path))
                              if name.split(".")[1] in above]
    assert not crossings, "; ".join(crossings)


def test_the_old_flat_module_paths_import_the_moved_modules_with_a_warning():
    """0.2's ``nemo_jq.trainer`` and friends still import, for one release, as the very module they moved to (a patch
    through either name patches both), each saying where it lives now."""
    code = ("import warnings, importlib, sys; warnings.simplefilter('error', DeprecationWarning)\n"
            "from nemo_jq._moved import MOVED\n"
            "for old, new in MOVED.items():\n"
            "    try:\n"
            "        importlib.import_module('nemo_jq.' + old)\n"
            "    except DeprecationWarning as warning:\n"
            "        assert str(warning).startswith(f'nemo_jq.{old} moved to nemo_jq.{new} '), warning\n"
            "    else:\n"
            "        raise AssertionError(f'nemo_jq.{old} imported without a warning')\n"
            "warnings.simplefilter('ignore', DeprecationWarning)\n"
            "from nemo_jq import trainer, distributed\n"
            "import nemo_jq.recipe.trainer, nemo_jq.runtime.distributed\n"
            "assert trainer is nemo_jq.recipe.trainer and distributed is nemo_jq.runtime.distributed\n"
            "assert not [m for m in MOVED if __import__('pathlib').Path('nemo_jq', *m.split('.')).with_suffix('.py').exists()]\n"
            "print(len(MOVED))")
    result = _run(["-c", code])
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == 21
