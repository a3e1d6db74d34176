"""Ways to cut a text into stream deltas, for the parsers' tests: a streamed parse must equal the whole one under
every one of them."""

import random
from collections.abc import Iterator


def random_chunkings(text: str, seeds: range, max_cuts: int) -> Iterator[list[str]]:
    """Seeded random chunkings of text into up to max_cuts + 1 pieces."""
    for seed in seeds:
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, max_cuts)))) \
            if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def chunkings(text: str, max_cuts: int) -> Iterator[list[str]]:
    """Every split in two (empty pieces included), one character at a time, and seeded random chunkings."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    yield from random_chunkings(text, range(4), max_cuts)
