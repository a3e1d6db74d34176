"""A one-line progress bar on stderr (redrawn in place on a terminal, a few lines otherwise)."""

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, width: int = 30) -> None:
        self.label, self.total, self.width = label, max(total, 1), width
        self.done = 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_tenth = -1

    def advance(self, count: int = 1) -> None:
        self.done += count
        filled = self.width * self.done // self.total
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.started:.1f} s")
        if self.tty:
            print("\r" + line, end="\n" if self.done >= self.total else "", file=sys.stderr, flush=True)
        elif 10 * self.done // self.total != self._last_tenth:
            self._last_tenth = 10 * self.done // self.total
            print(line, file=sys.stderr, flush=True)
