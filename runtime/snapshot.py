"""A benchmark's JSON report kept as a dated snapshot (`pegainfer bench ... --result-file FILE`): the figures with
when, on which commit and card, and by which command they were taken, which is what a row of docs/BENCHMARKS.md
cites."""

import json
import shlex
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pegainfer import __version__
from pegainfer.errors import PegainferError

CHECKOUT = Path(__file__).resolve().parent.parent


def snapshot(report: dict[str, Any], card: str | None, argv: list[str]) -> dict[str, Any]:
    """`report` with the date (UTC), the commit (or the package version outside a git checkout), the card and the
    command line (`pegainfer` and its arguments `argv`) that produced it."""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": source_revision(),
            "card": card, "command": shlex.join(["pegainfer", *argv]), **report}


def write_snapshot(path: Path, report: dict[str, Any], card: str | None, argv: list[str]) -> None:
    try:
        path.write_text(json.dumps(snapshot(report, card, argv), indent=1) + "\n")
    except OSError as error:
        raise PegainferError(f"--result-file {path}: cannot write it ({error.strerror or error})") from None


def source_revision() -> str:
    """The checkout's commit, marked +dirty with uncommitted changes; the version for an installed package."""
    try:
        done = subprocess.run(["git", "-C", str(CHECKOUT), "describe", "--always", "--dirty=+dirty", "--abbrev=7",
                               "--exclude=*"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return __version__
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else __version__
