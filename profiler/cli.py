"""m2r2-profile: where a decode step's time goes, against this machine's own limits, as a trace to open.

    m2r2-profile                                          # the default method on the embedded model, 64 tokens
    m2r2-profile --method plain --out build/profile       # each method into one folder: profile.png compares them
    m2r2-profile --model MOE_FOLDER --memory-budget 25%   # an MoE within an expert budget: loads, stalls, link
    MTL_CAPTURE_ENABLED=1 m2r2-profile --metal-capture decode.gputrace   # macOS: Xcode's capture of the decode

It decodes one answer twice, unmeasured and measured (each timed call evaluated at its boundary), and writes the
component table and roofline (Markdown and JSON), a Chrome trace-event file (ui.perfetto.dev opens it) and a
stacked bar per profiled method into --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import m2r2_mlx  # (first: preloads OpenBLAS on Linux before mlx.core)
from m2r2_mlx.atomic import atomic_write_text
from m2r2_mlx.decoding.options import add_model_options, add_options
from m2r2_mlx.errors import run_cli
from m2r2_mlx.moe.predictors import PREDICTORS

from .config import DEFAULT_PROMPT, DEFAULT_TOKENS, profile_config
from .plot import NO_MATPLOTLIB, plot
from .report import markdown, summary
from .session import run_profile
from .trace import write_trace

PROFILED_PREDICTORS = list(PREDICTORS)


class OneLineParser(argparse.ArgumentParser):
    """Bad flags are one line naming the problem (argparse's own words) and where the choices are."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="m2r2-profile", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {m2r2_mlx.__version__}")
    add_model_options(p, {n: PREDICTORS[n].help for n in PROFILED_PREDICTORS})
    add_options(p, skip=("max_tokens",))
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="the prompt to answer; - reads stdin")
    p.add_argument(
        "-n", "--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens to decode (default {DEFAULT_TOKENS})"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="decode each way this many times, alternating, and report the fastest of each: a shared machine's "
        "noise (default 1)",
    )
    p.add_argument(
        "--trace",
        default=None,
        metavar="FILE.json",
        help="where the Chrome trace-event file goes (default: OUT/trace-MODEL-MODE.json); Perfetto opens it",
    )
    p.add_argument(
        "--out",
        default="m2r2-profile-results",
        metavar="DIR",
        help="summaries, reports and the PNG (default m2r2-profile-results)",
    )
    p.add_argument(
        "--metal-capture",
        default=None,
        metavar="FILE.gputrace",
        help="macOS: capture the unmeasured decode with MLX's Metal capture for Xcode (needs MTL_CAPTURE_ENABLED=1)",
    )
    return p


def slug(model: str, label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{Path(model).name}-{label}").strip("-")


def _main() -> int:
    args = build_parser().parse_args()
    values = vars(args)
    if values["prompt"] == "-":
        values["prompt"] = sys.stdin.read()
    config = profile_config(values)
    profile = run_profile(config)
    facts = summary(profile)
    name = slug(profile.model, profile.label)
    out = config.out or Path(".")
    atomic_write_text(out / f"profile-{name}.json", json.dumps(facts, indent=1) + "\n")
    report = markdown(facts)
    atomic_write_text(out / f"profile-{name}.md", report)
    trace = write_trace(config.trace or out / f"trace-{name}.json", profile, facts)
    png = plot(out, out / "profile.png")
    print(report)
    if png is None:
        print(NO_MATPLOTLIB, file=sys.stderr)
    wrote = f"{out / f'profile-{name}.md'}" + (f", {png}" if png else "")
    print(f"wrote {wrote} and the trace {trace} (open it in ui.perfetto.dev)", file=sys.stderr)
    return 0


def main() -> None:
    sys.exit(run_cli("m2r2-profile", _main))


if __name__ == "__main__":
    main()
