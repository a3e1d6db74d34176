"""Pinned host memory a step's uploads and downloads pass through, two areas taken in turn: with steps overlapped
(the scheduler launching step N+1 before step N's tokens are read), step N+1 fills one area while the copies of
step N may still read or land in the other. An area is taken again only once the event recorded after its last
copies has fired."""

import numpy as np

from pegainfer.runtime.cuda import driver


class PinnedPair:
    def __init__(self, nbytes: int) -> None:
        self.areas = [driver.alloc_pinned(nbytes) for _ in range(2)]
        self.events = [driver.Event(timing=False) for _ in range(2)]
        self.recorded = [False, False]
        self.turn = 0

    def take(self) -> np.ndarray:
        """The next area, once the copies last queued through it are done."""
        self.turn ^= 1
        if self.recorded[self.turn]:
            self.events[self.turn].synchronize()
        return self.areas[self.turn]

    @property
    def current(self) -> np.ndarray:
        return self.areas[self.turn]

    def queued(self, stream) -> driver.Event:
        """Marks the copies queued so far through the current area; returns the event that fires after them."""
        self.events[self.turn].record(stream)
        self.recorded[self.turn] = True
        return self.events[self.turn]
