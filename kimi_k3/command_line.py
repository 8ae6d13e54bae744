"""One spelling per option across the project's commands: the training job's (``--snake_case``, the names of
``TrainingArguments`` where a knob is one of theirs). Options a command used to spell otherwise keep working for one
release, each announced with a deprecation line naming its new spelling."""

import sys


def respelled(argv: list[str], renamed: dict[str, str], prog: str) -> list[str]:
    """``argv`` with every old spelling of ``renamed`` (old -> new, ``--opt`` or ``--opt=value``) replaced by its new
    one; each old spelling used is named once on stderr."""
    announced, result = set(), []
    for argument in argv:
        option, equals, value = argument.partition("=")
        new = renamed.get(option)
        if new is None:
            result.append(argument)
            continue
        if option not in announced:
            print(f"{prog}: warning: {option} is now spelled {new}; the old spelling goes away in the next release",
                  file=sys.stderr)
            announced.add(option)
        result.append(f"{new}{equals}{value}")
    return result


def command_arguments(argv: list[str] | None) -> list[str]:
    """The command's arguments: ``argv``, or the process's own."""
    return sys.argv[1:] if argv is None else list(argv)
