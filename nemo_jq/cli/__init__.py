"""The ``nemo-jq`` command: a dispatcher over one module per command (``nemo_jq/cli/<command>.py``, each with its
``add_parser`` and ``run``), and the one-line messages every command gives for bad input."""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import sys
from typing import Callable

from nemo_jq.registry import out_of_memory
from nemo_jq.runtime.preemption import (
    Stopped,
    Terminated,
    ended_by_signals,
    guard_terminal_streams,
    signal_name,
    stop_with_parent,
)

#: Set to 1 (or pass --debug) to see the traceback behind an error message.
DEBUG_ENV = "NEMO_JQ_DEBUG"
#: The commands, in the order ``nemo-jq --help`` lists them: module names under nemo_jq.cli.
COMMANDS = ("train", "sweep", "report", "evaluate", "generate", "export", "experiment", "data", "plan", "launch", "dryrun", "doctor",
            "theory")


class OneLineErrors(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (the usage block above it buried the error), pointing at ``--help``,
    and an option of one value given twice is refused (argparse keeps the last: ``--config a.yaml --config b.yaml``
    trained on b.yaml alone, a.yaml's keys unread without a word); its subcommands' parsers are of this class too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("action", None, GivenOnce)
        self.register("action", "store", GivenOnce)

    def parse_known_args(self, args=None, namespace=None):
        self.given_once: dict[str, str] = {}  # this parse's options of one value, as given
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def format_help(self) -> str:
        if callable(self.epilog):  # a listing made when shown: the parser's build (every command's) imports no torch
            self.epilog = self.epilog()
        return super().format_help()


class GivenOnce(argparse._StoreAction):
    """An option's value, given at most once per command (:class:`OneLineErrors`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(parser, "given_once", {})
        words = " ".join(map(str, values)) if isinstance(values, list) else str(values)
        if option_string is not None and self.dest in given:
            parser.error(f"{option_string} given twice ({given[self.dest]}, then {words}): " + (
                f"give its values after one ({option_string} {given[self.dest]} {words})" if self.nargs in ("+", "*")
                else "give it once"))
        given[self.dest] = words
        super().__call__(parser, namespace, values, option_string)


#: A ``section.key=value`` override word, or ``plugins=``, the config's one key outside a section (a value of an
#: option of several values stops before one).
OVERRIDE_WORD = re.compile(r"([A-Za-z_][\w-]*(\.[\w-]+)+|plugins)=")


def parse_words(parser: argparse.ArgumentParser, words: list[str] | None,
                errors_of: Callable[[argparse.Namespace], argparse.ArgumentParser] | None = None,
                subcommands: dict[str, argparse.ArgumentParser] | None = None) -> argparse.Namespace:
    """``words`` read by ``parser`` as ``nemo-jq`` reads a command: key=value words after an option are overrides too,
    those right after an option of several values (``--seeds 1 2 3 guard.enabled=true``; argparse would take them as
    its values) included; any other stray word is one line from the parser ``errors_of`` names (the command's own),
    exit 2. ``subcommands``: the parsers of ``parser``'s commands, whose options of several values these are."""
    words = list(sys.argv[1:] if words is None else words)
    taken = pulled_overrides(words, parser, subcommands or {})
    args, extra = parser.parse_known_args([word for index, word in enumerate(words) if index not in taken])
    stray = [word for word in extra if word.startswith("-") or "=" not in word]
    extra += [words[index] for index in sorted(taken)]
    if stray or (extra and not hasattr(args, "overrides")):
        (errors_of(args) if errors_of else parser).error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:  # key=value words after an option land here; all of them in the order given
        args.overrides = sorted([*args.overrides, *extra], key=words.index)
    return args


def pulled_overrides(words: list[str], parser: argparse.ArgumentParser,
                     subcommands: dict[str, argparse.ArgumentParser]) -> set[int]:
    """The places of the override words that follow the values of an option of several values (``nargs`` + or *),
    in the command's parser (the first word naming one of ``subcommands``) or ``parser``."""
    command = next((subcommands[word] for word in words if word in subcommands), parser)
    several = {flag for action in command._actions if action.nargs in ("+", "*") for flag in action.option_strings}
    taken, inside = set(), False
    for index, word in enumerate(words):
        if word.startswith("-"):
            inside = word in several
        elif inside and OVERRIDE_WORD.match(word):
            taken.add(index)
    return taken


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the command began (its imports, its arguments): nothing written, nothing to say
        print("nemo-jq: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    stop_with_parent()
    guard_terminal_streams()
    parser = OneLineErrors(prog="nemo-jq", description="Post-train reasoning LLMs on the J_Q loss continuum.")
    parser.add_argument("--debug", action="store_true", help=f"show the traceback behind an error (or set {DEBUG_ENV}=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        importlib.import_module(f"nemo_jq.cli.{command}").add_parser(commands)

    args = parse_words(parser, argv, lambda args: commands.choices[args.command], commands.choices)
    try:
        with ended_by_signals():
            code = args.run(args)
        if not code:  # every rank got here: end the process groups together (a failed rank's peers are stopped)
            from nemo_jq.runtime import distributed

            distributed.close()
        return code
    except BrokenPipeError:  # the reader went away (``nemo-jq plan ... | head -1``): the rest is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so Python's exit-time flush stays quiet
        return 0
    except KeyboardInterrupt:
        print(f"nemo-jq {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated as stop:
        print(f"nemo-jq {args.command}: stopped by {signal_name(stop.signum)}", file=sys.stderr, flush=True)
        return 128 + stop.signum
    except Stopped as stopped:  # a signal ended a command of several runs: it says what finished, how to go on
        print(stopped, file=sys.stderr, flush=True)
        return stopped.exit_code
    except Exception as err:
        from nemo_jq.runtime import distributed

        message = user_error_message(err, args.command)
        if message is None or args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        # rank 0 names the failed rank; that rank prints its own message
        if distributed.is_writer() or not isinstance(err, distributed.OtherRankFailed):
            where = "" if distributed.is_writer() else f" (rank {distributed.rank()})"
            print(f"nemo-jq {args.command}{where}: error: {message}", file=sys.stderr, flush=True)
        distributed.await_failing_ranks()
        return 2


def user_error_message(err: BaseException, command: str = "train") -> str | None:
    """One line for an error that ordinary bad input causes (None for a bug: its traceback is shown); a path the
    ``command`` cannot write is the one its fix names (a report's, not a run's ``train.run_dir``).

    Under torchrun, rank 0 also names any other rank that failed, and each failed rank prints its own.
    """
    from nemo_jq.runtime import distributed

    if isinstance(err, OSError) and err.errno is not None and err.filename is not None:
        written = {"train": "train.run_dir (or --demo-dir)", "report": "--csv, --json or --figures path", "eval": "path",
                   "generate": "path", "plan": "path", "dryrun": "path", "doctor": "path"}.get(command, "--out")
        resumes = ("; the last good checkpoint (checkpoints/latest) is still loadable, so `nemo-jq train --resume "
                   "RUN_DIR` continues" if command == "train" else "")
        hints = {
            errno.ENOSPC: f"free some space or choose another {written}{resumes}",
            errno.EDQUOT: "free some of your quota (`lfs quota -u $USER PATH` on Lustre, `quota -s` elsewhere) or choose "
                          f"another {written}{resumes}",
            errno.EACCES: f"make it writable or choose another {written}",
            errno.EROFS: f"choose a writable {written}",
            errno.EPERM: f"make it writable or choose another {written}",
            errno.EISDIR: "it is a folder: give a file's path",
            errno.ENOTDIR: "a part of that path is a file, not a folder: give another path",
            errno.EEXIST: "a file is there where a folder is wanted: give another path",
            errno.ENOENT: "check the path (a relative one is read from the current directory)",
        }
        reason = "no space left on device" if err.errno == errno.ENOSPC else (err.strerror or str(err)).lower()
        return f"{reason}: {err.filename}" + (f"; {hints[err.errno]}" if err.errno in hints else "")
    if out_of_memory(err):
        said = str(err).strip().splitlines()[0][:240]
        return (f"out of memory ({said}): lower what a step holds at once (rollout.kv_cache_tokens, "
                "train.micro_batch_rows, eval.batch_size, eval.num_samples or rollout.num_samples); `nemo-jq dryrun "
                "--config C.yaml` finds a run's peak, and the setting that shrinks it, before it starts")
    if isinstance(err, KeyError) and not (err.args and " " in str(err.args[0])):
        return None  # a bare key looked up and missing is a bug (the registries' KeyErrors are sentences)
    if isinstance(err, (ValueError, OSError, KeyError, distributed.OtherRankFailed)):
        text = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
        return " ".join(str(text).split())
    return None
