"""The scheduler's waiting requests, in the order admission takes them: preempted sequences first, then the oldest
request of the group with the fewest running sequences (runtime/scheduler.py says why)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pegainfer.runtime.request_state import RequestState


class WaitingQueue:
    """The requests waiting for admission. Preempted ones come first, the last preempted at the head; then the
    oldest request of the group with the fewest running sequences. A heap of (running, head's seq id, group) finds
    that group in O(log n); entries a change made outdated stay in it and are dropped when they reach the top."""

    def __init__(self) -> None:
        self._resumed: deque[RequestState] = deque()
        self._groups: dict[str | int, deque[RequestState]] = {}  # never-admitted requests by group, in arrival order
        self._running: dict[str | int, int] = {}  # running sequences by group; absent: none
        self._heap: list[tuple[int, int, str | int]] = []
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[RequestState]:
        """Resumed ones first, then the rest in arrival order (for inspection: admission also weighs groups)."""
        yield from self._resumed
        yield from heapq.merge(*self._groups.values(), key=lambda state: state.seq.seq_id)

    def __getitem__(self, index: int) -> RequestState:
        for i, state in enumerate(self):
            if i == index:
                return state
        raise IndexError(f"waiting index {index} is out of range: {self._size} requests are waiting")

    def append(self, state: RequestState) -> None:
        queue = self._groups.setdefault(state.group, deque())
        queue.append(state)
        self._size += 1
        if len(queue) == 1:
            self._push(state.group)

    def appendleft(self, state: RequestState) -> None:
        """A preempted sequence: it resumes before any new request."""
        self._resumed.appendleft(state)
        self._size += 1

    def peek(self) -> RequestState | None:
        """The request admission takes next, or None when none waits."""
        if self._resumed:
            return self._resumed[0]
        while self._heap:
            running, head, group = self._heap[0]
            queue = self._groups.get(group)
            if queue and queue[0].seq.seq_id == head and self._running.get(group, 0) == running:
                return queue[0]
            heapq.heappop(self._heap)
        return None

    def popleft(self) -> RequestState:
        """Takes the request `peek` names."""
        state = self.peek()
        assert state is not None, "popleft on an empty waiting queue"
        if self._resumed:
            self._resumed.popleft()
        else:
            heapq.heappop(self._heap)  # peek left the state's entry at the top
            self._groups[state.group].popleft()
            self._settle(state.group)
        self._size -= 1
        return state

    def remove(self, state: RequestState) -> None:
        if state.admitted:  # preempted: only admitted requests ever are
            self._resumed.remove(state)
        else:
            self._groups[state.group].remove(state)
            self._settle(state.group)
        self._size -= 1

    def started(self, state: RequestState) -> None:
        """`state` joined the running batch: its group's later requests weigh one more running sequence."""
        self._running[state.group] = self._running.get(state.group, 0) + 1
        self._push(state.group)

    def stopped(self, state: RequestState) -> None:
        group = state.group
        left = self._running[group] - 1
        if left:
            self._running[group] = left
        else:
            del self._running[group]
        self._push(group)

    def _settle(self, group: str | int) -> None:
        """After a group's queue lost a request: a new head needs its entry, an empty queue goes."""
        if self._groups[group]:
            self._push(group)
        else:
            del self._groups[group]

    def _push(self, group: str | int) -> None:
        """Adds the group's current entry; rebuilds the heap once outdated entries outnumber the live ones."""
        queue = self._groups.get(group)
        if not queue:
            return
        heapq.heappush(self._heap, (self._running.get(group, 0), queue[0].seq.seq_id, group))
        if len(self._heap) > 2 * len(self._groups) + 64:
            self._heap = [(self._running.get(g, 0), q[0].seq.seq_id, g) for g, q in self._groups.items()]
            heapq.heapify(self._heap)
