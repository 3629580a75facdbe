"""Every command the README and docs/*.md show runs with today's flags: each fenced `m2r2-*`, `python -m ...` or
`torchrun ... -m ...` command is parsed by its own argument parser (nothing decodes), so a renamed flag, method or
subcommand fails here, naming the page and line.

Synopses are read as such: `[...]` groups are included, `a|b` alternatives are each tried, `...` is dropped, a
bracketed phrase of plain words (`[the chat's flags]`) is prose and dropped, and an upper-case placeholder given to an
option that needs a number or a choice (`--steps N`, `--method MODE`) takes that option's default or first choice.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console", "zsh"}
SCRIPTS = {e.name: e.value.split(":")[0] for e in entry_points(group="console_scripts") if e.name.startswith("m2r2-")}
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(?:[./][A-Za-z0-9_.*]+)*")
PROSE = re.compile(r"\[([^\[\]]*)\]")
CUT = {"&&", "||", ";", ">", ">>", "2>", "2>&1", "&"}


@dataclass(frozen=True)
class Command:
    page: str  # relative to the repository
    line: int
    text: str  # as the page shows it, continuations joined

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def fenced_lines(text: str):
    """(line number, line) of every line inside a shell code fence, backslash continuations joined."""
    fence, pending, start = None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            m = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if m:
                fence = (m.group(1), m.group(2).lower())
            continue
        if stripped.startswith(fence[0]) and not stripped.strip(fence[0][0]):
            fence, pending = None, ""
            continue
        if fence[1] not in SHELL:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + stripped
        pending = ""


def commands() -> list[Command]:
    found = []
    for page in PAGES:
        for number, line in fenced_lines(page.read_text()):
            line = line.removeprefix("$ ")
            for part in re.split(r"\s(?:&&|\|\||;)\s", line):
                words = _words(part)
                if words and (re.fullmatch(r"m2r2-[\w-]+", words[0]) or _module_of(words) is not None):
                    found.append(Command(str(page.relative_to(ROOT)), number, part.strip()))
    return found


def _words(text: str) -> list[str]:
    """A command line's words, without the VAR=value assignments before the command."""
    words = text.split()
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        words.pop(0)
    return words


def _module_of(words: list[str]) -> str | None:
    """The module a `python -m MOD` or `torchrun ... -m MOD` line runs."""
    if words[0] in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        return words[2]
    if words[0] == "torchrun" and "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    return None


# --- synopses: [groups], a|b alternatives, ... ---


def _tree(tokens: list[str]) -> list:
    """Tokens into a sequence of words and groups; a group is a list of alternatives, each a sequence. The top level
    is a group of one alternative (so `list | verify NAME` at top level reads as alternatives)."""
    stack: list[list[list]] = [[[]]]
    for token in tokens:
        word = token.lstrip("[")
        for _ in range(len(token) - len(word)):
            stack.append([[]])
        closes = len(word) - len(word.rstrip("]"))
        word = word.rstrip("]")
        if word == "|":
            stack[-1].append([])
        elif word and word != "...":
            stack[-1][-1].append(word)
        for _ in range(closes):
            if len(stack) > 1:
                group = stack.pop()
                stack[-1][-1].append(group)
    while len(stack) > 1:  # an unclosed group ends with the line
        group = stack.pop()
        stack[-1][-1].append(group)
    return stack[0]


def _variants(item) -> list[list[str]]:
    """The token lists an item stands for, its default first: every group included with its first alternative, then
    each other alternative in turn with everything else at its default."""
    if isinstance(item, str):
        words = [w for w in item.split("|") if w and w != "..."] if "|" in item else [item]
        return [[w.removesuffix(",...")] for w in words] or [[]]
    return [v for alternative in item for v in _sequence(alternative)]


def _sequence(items: list) -> list[list[str]]:
    options = [_variants(i) for i in items]
    default = [t for o in options for t in o[0]]
    out = [default]
    for k, o in enumerate(options):
        for other in o[1:]:
            out.append([t for j, p in enumerate(options) for t in (other if j == k else p[0])])
    return out


def expand(argv_text: str) -> list[list[str]]:
    """A command's arguments (as the page writes them) as the argument lists to parse."""
    text = PROSE.sub(lambda m: "" if _is_prose(m.group(1)) else m.group(0), argv_text)
    tokens = shlex.split(text, comments=True)
    for k, t in enumerate(tokens):
        if t in CUT or t.startswith((">", "2>")):
            tokens = tokens[:k]
            break
    return _variants(_tree(tokens))


def _is_prose(inside: str) -> bool:
    words = inside.split()
    return len(words) > 1 and not any(w.startswith("-") or w == "|" for w in words)


# --- parsers ---


def parser_for(command: Command, argv: list[str]):
    """The command's own parser and the arguments it reads."""
    words = _words(command.text)
    module_name = SCRIPTS.get(words[0]) or _module_of(words)
    if module_name is None:
        raise LookupError(f"no command {words[0]} (the installed ones: {', '.join(sorted(SCRIPTS))})")
    try:
        module = importlib.import_module(module_name)
        if hasattr(module, "__path__"):  # python -m PACKAGE runs PACKAGE.__main__
            module = importlib.import_module(module_name + ".__main__")
    except ImportError as e:
        raise LookupError(f"module {module_name} does not import: {e}") from None
    if hasattr(module, "parser_for"):
        return module.parser_for(argv)
    if hasattr(module, "build_parser"):
        return module.build_parser(), argv
    return None, argv


def arguments(command: Command) -> str:
    """The text after the command (and after `python -m MOD`, or torchrun's own flags and `-m MOD`)."""
    words = _words(command.text)
    skip = 1 if words[0].startswith("m2r2-") else words.index("-m") + 2
    return " ".join(words[skip:])


def _actions(parser, argv: list[str]):
    """Option string -> action, following the subcommands the arguments name."""
    import argparse

    table = {}
    for action in parser._actions:
        for flag in action.option_strings:
            table[flag] = action
        if isinstance(action, argparse._SubParsersAction):
            for word in argv:
                if word in action.choices:
                    table.update(_actions(action.choices[word], argv))
                    break
    return table


def fill_placeholders(parser, argv: list[str]) -> list[str]:
    """An upper-case placeholder given to an option that takes a number or a choice becomes that option's default
    (or first choice): the page shows the flag, not a value."""
    actions = _actions(parser, argv)
    out = list(argv)
    for k, word in enumerate(argv[1:], 1):
        action = actions.get(argv[k - 1].split("=")[0])
        if action is None or action.nargs == 0 or not PLACEHOLDER.fullmatch(word):
            continue
        if action.choices:
            out[k] = str(next(iter(action.choices)))
        elif action.type not in (None, str, Path):
            out[k] = str(action.default) if action.default not in (None, [], ()) else "1"
    return out


def check(command: Command) -> list[str]:
    """Every way the command's synopsis can be read that its parser refuses, in the parser's own words."""
    problems = []
    for argv in expand(arguments(command)):
        try:
            parser, argv = parser_for(command, argv)
        except LookupError as e:
            return [str(e)]
        if parser is None:
            if argv:
                problems.append(f"{' '.join(argv)}: the module has no build_parser() to read its arguments")
            continue
        argv = fill_placeholders(parser, argv)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(argv)
        except SystemExit as e:
            if e.code:
                problems.append(f"{' '.join(argv)}: {err.getvalue().strip().splitlines()[-1]}")
            continue
        flags = _actions(parser, argv)
        short = [w for w in argv if w.startswith("--") and w.split("=")[0] not in flags]
        if short:  # argparse takes a unique prefix, so a renamed --max-tokens-per-turn would still read --max-tokens
            problems.append(f"{' '.join(argv)}: {', '.join(short)} abbreviated; spell the flag out")
    return problems


COMMANDS = commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 20, [str(c) for c in COMMANDS]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.page}:{c.line}")
def test_command_parses(command):
    problems = check(command)
    assert not problems, f"{command}\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "text, renamed",
    [
        ("m2r2-chat --method speculative --max-tokens 64", "m2r2-chat --drafter fast --max-tokens 64"),
        ("m2r2-profile --method early-exit -n 64", "m2r2-profile --method m2r2 -n 64"),
        ("m2r2-bench --methods plain,speculative,fast,lookup --limit 2", "m2r2-bench --methods plain,m2r2,lookup"),
        ("m2r2-bench --structured --methods plain,lookup --order shuffled", "m2r2-bench --structured --order random"),
        ("m2r2-chat [--method plain|speculative|lookup] [--tau T]", "m2r2-chat [--method plain|layerskip] [--tau T]"),
        ("m2r2-convert ckpt.pt --base smollm2 -o out [--gates 6,12 | --every 6]", "m2r2-convert fetch ckpt.pt -o out"),
        ("python -m experiments.gate_agreement --per-category 2", "python -m experiments.gate_agreement --per-cat 2"),
    ],
)
def test_a_renamed_flag_or_method_fails(text, renamed):
    """The check can fail: today's command passes, the same command with a name it no longer has does not."""
    assert not check(Command("example.md", 1, text))
    assert check(Command("example.md", 1, renamed))


def test_synopses_read_as_each_alternative():
    assert expand("list | verify [NAME] | remove NAME [--yes]") == [
        ["list"],
        ["verify", "NAME"],
        ["remove", "NAME", "--yes"],
    ]
    assert expand("[--mode a|b] [the chat's flags] --text FILE ...  # a comment") == [
        ["--mode", "a", "--text", "FILE"],
        ["--mode", "b", "--text", "FILE"],
    ]


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_every_relative_link_resolves():
    """A page deleted or moved breaks no link in the README or docs/."""
    broken = [
        f"{page.relative_to(ROOT)}:{number}: {target}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for target in LINK.findall(line)
        if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists()
    ]
    assert not broken, "\n".join(broken)
