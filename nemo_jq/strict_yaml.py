"""YAML read strictly, for configs and launch files: a key given twice in a mapping is an error naming its line (PyYAML's
``safe_load`` keeps the last silently: a second ``train:`` dropped the first's ``run_dir``, and a run went to the wrong
folder), as are a file that is not UTF-8 and a folder given for a file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nemo_jq.typed import ConfigError, utf8_text


def read_yaml_file(path: Path) -> Any:
    """The YAML the file at ``path`` holds; a folder, or a file that is not UTF-8, is an error saying what to pass."""
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: it must be a YAML file")
    return parse_yaml(utf8_text(path, path.read_bytes(), error=ConfigError), str(path))


def parse_yaml(text: str, where: str, fix: str = "fix the syntax there") -> Any:
    """``text`` (from ``where``) as YAML; a syntax error or a key given twice is one line saying where, and ``fix``.
    An alias (``eval: *r``) is a copy of its anchor's value, not the same object: an override of one section edited
    the other too."""
    try:
        return _unshared(yaml.load(text, Loader=_UniqueKeyLoader), where)
    except _DuplicateKey as err:
        key, line, first_line = err.args
        raise ConfigError(f"{where}:{line}: key '{key}' is given twice (first on line {first_line}): keep one (YAML "
                          "would silently use the last)") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        place = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{place}: invalid YAML ({problem}); {fix}") from None


#: The most values a YAML file may expand to through its aliases (nested aliases multiply: "a billion laughs").
MOST_VALUES = 1_000_000


def _unshared(value: Any, where: str) -> Any:
    """``value`` with every mapping and list its own (``copy.deepcopy`` keeps the objects aliases share shared)."""
    count, inside = 0, set()

    def copy(item: Any) -> Any:
        nonlocal count
        count += 1
        if count > MOST_VALUES:
            raise ConfigError(f"{where}: its aliases expand to more than {MOST_VALUES:,} values: write the values out")
        if not isinstance(item, (dict, list)):
            return item
        if id(item) in inside:  # `a: &x {b: *x}`
            raise ConfigError(f"{where}: an alias refers to the value that holds it: write the values out")
        inside.add(id(item))
        copied = {key: copy(inner) for key, inner in item.items()} if isinstance(item, dict) else [copy(inner) for inner in item]
        inside.discard(id(item))
        return copied

    return copy(value)


class _DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping: (its dotted path, its line, the first one's line)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice is an error: safe_load silently keeps the last, so a second
    ``train:`` dropped the first's run_dir and a run went to the wrong folder."""

    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_duplicate_keys(node, "", set())
        return super().construct_document(node)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer, but not YAML 1.1's octal (``010``) or base 60 (``1:10``): a seed of ``010`` trained as 8."""
        value, text = super().construct_yaml_int(node), self.construct_scalar(node)
        digits = text.replace("_", "").lstrip("+-")
        if ":" in digits or (len(digits) > 1 and digits[0] == "0" and digits[1] not in "xXbB"):
            raise yaml.constructor.ConstructorError(
                None, None, f"{text} reads as {value} in YAML (an octal or base-60 number): write {value} for that "
                f"number, or quote it as text: \"{text}\"", node.start_mark)
        return value


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)


def _refuse_duplicate_keys(node: yaml.Node, prefix: str, walked: set[int]) -> None:
    """Raise :class:`_DuplicateKey` for the first key given twice in any mapping under ``node`` (``walked``: the nodes
    seen, as an alias may point back up)."""
    if id(node) in walked:
        return
    walked.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_duplicate_keys(item, f"{prefix}[{index}]", walked)
    elif isinstance(node, yaml.MappingNode):
        first_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in first_lines:
                raise _DuplicateKey(key, line, first_lines[key])
            first_lines[key] = line
            _refuse_duplicate_keys(value_node, key, walked)
