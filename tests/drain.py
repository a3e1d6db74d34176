"""A scheduler stepped to the end in a test, every request's TokenOutputs in order (none for a request that made
none)."""

from collections import defaultdict

from pegainfer.runtime.requests import TokenOutput


def drain(scheduler) -> dict[str, list[TokenOutput]]:
    made: dict[str, list[TokenOutput]] = defaultdict(list)
    while scheduler.has_work():
        for token in scheduler.step():
            made[token.request_id].append(token)
    return made
