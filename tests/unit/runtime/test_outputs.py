"""``runtime/outputs.py``'s staged writes: a folder's files written beside it, then moved in whole."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from doc_pages import ROOT

from nemo_jq.runtime.outputs import RunDirInUse, staged, write_new


def test_a_move_into_the_folder_that_fails_leaves_no_copy_of_the_write_beside_it(tmp_path, monkeypatch):
    """A move into ``folder`` that failed after the whole write (a full disk, its name taken meanwhile) left the staged
    copy of every file beside it, taking its room until the next write of it."""
    folder = tmp_path / "exported"
    replace = os.replace

    def fails_at_the_second(source, target):
        if sorted(tmp_path.rglob("*")).count(folder / "a.txt"):
            raise OSError(28, "No space left on device", str(target))
        return replace(source, target)

    monkeypatch.setattr(os, "replace", fails_at_the_second)
    with pytest.raises(OSError, match="No space left"):
        with staged(folder, last="b.txt") as staging:
            (staging / "a.txt").write_text("a")
            (staging / "b.txt").write_text("b")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["exported"]
    monkeypatch.setattr(os, "replace", replace)
    with staged(folder, last="b.txt") as staging:  # the next write of it
        (staging / "b.txt").write_text("b")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["exported"] and (folder / "b.txt").read_text() == "b"


def test_a_second_write_of_a_folder_being_written_is_refused_naming_the_writer(tmp_path):
    """Two writes of one folder (two exports to one --out) shared its staging folder: the second deleted the first's
    files, and the first moved the second's half-written ones in, marked whole. The first write's files stand."""
    folder = tmp_path / "exported"
    script = tmp_path / "writer.py"
    script.write_text("import sys\nfrom pathlib import Path\nfrom nemo_jq.runtime.outputs import staged\n\n"
                      "with staged(Path(sys.argv[1]), last='b.txt') as staging:\n"
                      "    (staging / 'a.txt').write_text('first')\n    print('writing', flush=True)\n"
                      "    sys.stdin.read()\n    (staging / 'b.txt').write_text('first')\n")
    writer = subprocess.Popen([sys.executable, script, folder], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert writer.stdout.readline().strip() == "writing"
        with pytest.raises(RunDirInUse, match=f"{folder} is being written now by another process \\(pid {writer.pid} "):
            with staged(folder, last="b.txt") as staging:
                (staging / "b.txt").write_text("second")
    finally:
        writer.communicate("", timeout=60)
    assert writer.returncode == 0 and {path.name: path.read_text() for path in folder.iterdir()} == {
        "a.txt": "first", "b.txt": "first"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["exported", "writer.py"]


def test_two_evals_of_one_step_at_once_keep_both_reports(tmp_path, monkeypatch):
    """Two ``nemo-jq eval`` of one split and step at once both found ``validation-step_N.json`` free and moved their
    reports onto it: the second replaced the first's. Here the other eval's report lands while this one writes its
    own, which then goes beside it."""
    from nemo_jq.runtime import outputs
    from nemo_jq.runtime.runs import write_evaluation

    (tmp_path / "run").mkdir()
    other = tmp_path / "run" / "evals" / "validation-step_00000002.json"
    written = outputs.fsync

    def the_other_eval_writes_meanwhile(path):
        written(path)
        if not other.exists():
            other.write_text('{"other": true}\n')

    monkeypatch.setattr(outputs, "fsync", the_other_eval_writes_meanwhile)
    path = write_evaluation(tmp_path / "run", "validation", 2, {"this": True})
    assert path.name == "validation-step_00000002-2.json" and '"this": true' in path.read_text()
    assert other.read_text() == '{"other": true}\n'
    assert {p.name for p in other.parent.iterdir()} == {other.name, path.name}  # no temporary file left


def test_write_new_leaves_a_taken_name_as_it_is(tmp_path):
    taken = tmp_path / "report.json"
    taken.write_text("mine")
    assert not write_new(taken, "theirs") and taken.read_text() == "mine"
    assert write_new(tmp_path / "free.json", "theirs") and (tmp_path / "free.json").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["free.json", "report.json"]


@pytest.mark.parametrize("refusal", [1, 95])  # EPERM, EOPNOTSUPP: what link says where there are no hard links
def test_write_new_takes_the_name_without_hard_links(tmp_path, monkeypatch, refusal):
    """On vfat, exFAT or a FUSE mount a link is refused: the report was lost (a traceback, or "cannot be written")."""
    def no_links(source, target):
        raise OSError(refusal, os.strerror(refusal), str(source), None, str(target))

    monkeypatch.setattr(os, "link", no_links)
    taken = tmp_path / "report.json"
    assert write_new(taken, "first") and not write_new(taken, "second") and taken.read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
