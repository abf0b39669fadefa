"""``runtime/outputs.py``'s staged writes: a folder's files written beside it, then moved in whole."""

from __future__ import annotations

import os

import pytest

from nemo_jq.runtime.outputs import staged


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
