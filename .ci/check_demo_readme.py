"""Fail when README.md's demo table differs from what the demo just wrote (its summary.json).

The demo is deterministic on a given machine kind, so a difference means the README is stale
or the main job has regressed. Usage: python .ci/check_demo_readme.py SUMMARY_JSON README_MD
"""

import json
import sys
from pathlib import Path

from nemo_jq.recipe.demo import markdown_table


def main(summary_path: str, readme_path: str) -> int:
    expected = markdown_table(json.loads(Path(summary_path).read_text()))
    readme = Path(readme_path).read_text()
    if expected in readme:
        print(f"README demo table matches {summary_path}")
        return 0
    header = expected.splitlines()[0]
    start = readme.find(header)
    found = "\n".join(readme[start:].splitlines()[: len(expected.splitlines())]) if start >= 0 else "(no demo table found)"
    print(f"README.md's demo table differs from {summary_path}.\nREADME has:\n{found}\nThe demo wrote:\n{expected}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
