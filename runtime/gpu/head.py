"""A draft head (EAGLE-3, MTP: runtime/drafters.py) on the GPU: its graphs on engines beside the target's, the
second taking the first's KV cache and weights, both borrowing the params the target holds alike (its embedding,
an MTP head's LM head). Steps of one token a sequence replay CUDA graphs per bucket, as the target's decode steps,
and so do catch-ups over what a verify step kept (the target's verify width); a catch-up longer than a step's
limits runs in several."""

from dataclasses import replace
from pathlib import Path

import numpy as np

from pegainfer.frontends.drafter_load import DraftHead
from pegainfer.frontends.load import LoadedModel
from pegainfer.runtime.batch import Chunk
from pegainfer.runtime.drafters import head_inputs
from pegainfer.runtime.gpu.engine import GpuEngine
from pegainfer.runtime.gpu.start import gpu_engine
from pegainfer.runtime.sampler import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class GpuHead:
    def __init__(self, head: DraftHead, target: GpuEngine, kv_tokens: int, cache_dir: Path | None = None) -> None:
        """A KV cache of `kv_tokens` (the target's pool and the drafts past it), the target's other limits."""
        # the target's verify width: a catch-up over the tokens a step kept (1 + those accepted) replays a graph
        options = replace(target.options, kv_tokens=kv_tokens, spare_states=0, state_snapshots=0, kv_share=1.0,
                          reserved_bytes=0)
        spec = head.spec

        def model(graph) -> LoadedModel:
            return LoadedModel(replace(spec, graph=graph), spec.config_path.parent, head.weights)
        first = gpu_engine(model(head.first), options, cache_dir, lenders=((target, head.from_target),))
        second = first if head.next is head.first else \
            gpu_engine(model(head.next), replace(options, max_tokens=options.max_batch), cache_dir,  # a token a seq
                       lenders=((first, None),), kv_of=first)
        self.engines = {True: first, False: second}
        for engine in self.engines.values():
            engine.token_output = engine.graph.outputs[1]  # the head's output at every token, before its norm
        self.allocator = first.allocator
        self.max_tokens, self.max_seqs = options.max_tokens, options.max_batch

    def run(self, first: bool, chunks: list[Chunk], features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each chunk's greedy draft and the head's output at its last token, in steps within the engine's limits
        (a chunk longer than what a step has left runs in parts, its draft drawn after the last)."""
        engine = self.engines[first]
        starts = np.cumsum([0] + [c.num_tokens for c in chunks])
        drawn: dict[int, tuple[int, np.ndarray]] = {}
        pending = [(i, c.num_tokens) for i, c in enumerate(chunks)]  # chunk, tokens left
        while pending:
            step, used = [], 0
            for i, left in pending:
                if len(step) == self.max_seqs or used == self.max_tokens:
                    break
                take = min(left, self.max_tokens - used)
                step.append((i, take, left))
                used += take
            rows = np.concatenate([features[starts[i + 1] - left: starts[i + 1] - left + take]
                                   for i, take, left in step])
            result = engine.sample([Chunk(chunks[i].seq, take) for i, take, _ in step], [GREEDY] * len(step),
                                   [0] * len(step), inputs=lambda packed: head_inputs(engine.graph,
                                                                                      packed["positions"], rows))
            ends = np.cumsum([take for _, take, _ in step]) - 1
            for (i, take, left), token, end in zip(step, result.tokens, ends):
                if take == left:
                    drawn[i] = (token, result.features[end])
            pending = [(i, left - take) for i, take, left in step if take < left] + pending[len(step):]
        order = range(len(chunks))
        return np.array([drawn[i][0] for i in order]), np.stack([drawn[i][1] for i in order])
