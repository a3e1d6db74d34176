"""Ordering a DAG given as names and edges: the passes' topological order and the verifier's cycle report. Plain
Kahn's algorithm (no graph library on the start-up path of a server, which lowers its model at every start)."""

import heapq
from collections.abc import Callable, Hashable, Iterable


def lexicographic_order(names: list[Hashable], edges: Iterable[tuple[Hashable, Hashable]],
                        key: Callable[[Hashable], object]) -> list[Hashable] | None:
    """A topological order that, among the nodes ready at each point, takes the one of least `key`; None when the
    edges hold a cycle."""
    successors: dict = {name: [] for name in names}
    indegree = dict.fromkeys(names, 0)
    position = {name: i for i, name in enumerate(names)}  # breaks ties of equal keys, so names are never compared
    for source, target in edges:
        successors[source].append(target)
        indegree[target] += 1
    ready = [(key(name), position[name], name) for name in names if indegree[name] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, _, name = heapq.heappop(ready)
        order.append(name)
        for target in successors[name]:
            indegree[target] -= 1
            if indegree[target] == 0:
                heapq.heappush(ready, (key(target), position[target], target))
    return order if len(order) == len(names) else None


def find_cycle(names: list[Hashable], edges: Iterable[tuple[Hashable, Hashable]]) -> list[Hashable]:
    """The nodes of one cycle in order (empty when there is none), by depth-first search."""
    successors: dict = {name: [] for name in names}
    for source, target in edges:
        successors[source].append(target)
    state: dict = {}  # 1: on the current path, 2: done
    for root in names:
        if root in state:
            continue
        path, stack = [], [(root, iter(successors[root]))]
        state[root] = 1
        path.append(root)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child):]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append((child, iter(successors[child])))
    return []
