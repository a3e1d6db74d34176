"""The pass manager: named passes in phases, each a function from graph to graph, verified before and after,
with the graph's text form recorded after each (the dumps of `--dump-after` and `inspect --show passes`)."""

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pegainfer.errors import GraphError
from pegainfer.ir.graph import Graph
from pegainfer.ir.printer import format_graph
from pegainfer.ir.verify import verify

PHASES = ("cleanup", "sharding", "weight_transforms", "fusion", "kernel_formation", "memory_planning")


@dataclass
class PassLog:
    """What a pass wants a reader of the dump to know: above all, patterns it found but could not rewrite."""
    notes: list[str] = field(default_factory=list)

    def note(self, message: str) -> None:
        self.notes.append(message)


@dataclass(frozen=True)
class Pass:
    name: str
    phase: str
    run: Callable[[Graph, PassLog], Graph]

    @property
    def summary(self) -> str:
        """The first line of the pass function's docstring: what it rewrites."""
        return (self.run.__doc__ or "").strip().splitlines()[0]


@dataclass(frozen=True)
class PassRecord:
    index: int
    name: str
    phase: str
    summary: str
    notes: tuple[str, ...]
    text: str  # the graph after the pass
    graph: Graph = field(repr=False, compare=False)  # the graph after the pass, for equivalence checks

    def dump(self) -> str:
        header = [f"# after pass {self.index}: {self.name} ({self.phase}): {self.summary}"]
        header += [f"# note: {note}" for note in self.notes]
        return "\n".join(header) + "\n" + self.text


def run_passes(graph: Graph, passes: list[Pass]) -> tuple[Graph, list[PassRecord]]:
    """Runs the passes in order; a pass never mutates its input. A malformed input graph fails verification
    naming the node, as does a pass that breaks the graph (naming the pass too)."""
    assert [p.phase for p in passes] == sorted((p.phase for p in passes), key=PHASES.index), \
        "passes must run phase by phase"
    verify(graph)
    records = []
    for index, step in enumerate(passes, start=1):
        log = PassLog()
        graph = step.run(copy.deepcopy(graph), log)
        try:
            verify(graph)
        except GraphError as error:
            raise GraphError(f"after pass {step.name}: {error}") from None
        records.append(PassRecord(index, step.name, step.phase, step.summary, tuple(log.notes),
                                  format_graph(graph), graph))
    return graph, records


def write_dumps(records: list[PassRecord], folder: Path, which: str = "all") -> list[Path]:
    """Writes `NN-<pass>.txt` for every pass, or for the one named by `which`."""
    names = [r.name for r in records]
    if which != "all" and which not in names:
        raise GraphError(f"--dump-after {which}: no such pass; passes: all, {', '.join(names)}")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for record in records:
        if which in ("all", record.name):
            path = folder / f"{record.index:02d}-{record.name}.txt"
            path.write_text(record.dump())
            written.append(path)
    return written
