"""The host KV tier on the CPU engine: a prefix the device pool had to evict is copied back from host blocks instead
of recomputed, giving a cold run's tokens and logprobs; under pressure on both tiers with random aborts every output
equals the request alone and every block of both tiers ends free or cached; async scheduling gives the plain steps'
tokens; a tier past the host's memory is refused with the numbers."""

import numpy as np
import pytest

from drain import drain
from pegainfer.errors import PegainferError
from pegainfer.frontends.load import load_model
from pegainfer.runtime.host_tier import GIB, HostTier, host_capacity
from pegainfer.runtime.reference_engine import ReferenceEngine
from pegainfer.runtime.requests import EngineRequest
from pegainfer.runtime.sampler import SamplingParams
from pegainfer.runtime.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint)


class LateRestores(ReferenceEngine):
    """Copies back that land only after a few queries, made then, or before a copy down from their device block or
    into their host block and before their device block is evicted (as a GPU's streams order them): a step
    reading a block before would see what it held before."""

    def __init__(self, *args, polls: int = 3, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending: list[list] = []
        self.waits, self.polls = 0, polls

    def restore_blocks(self, pairs: list[tuple[int, int]]) -> list:
        self.pending.append(handle := [pairs, self.polls])
        return handle

    def restore_done(self, handle: list) -> bool:
        handle[1] -= 1
        if handle[1] > 0:
            self.waits += 1
            return False
        self._land(handle)
        return True

    def settle_block(self, device_block: int) -> None:
        self._land_touching(device_block, None)

    def offload_block(self, device_block: int, host_block: int) -> None:
        self._land_touching(device_block, host_block)
        super().offload_block(device_block, host_block)

    def _land_touching(self, device_block: int, host_block: int | None) -> None:
        for handle in [h for h in self.pending if any(d == device_block or b == host_block for b, d in h[0])]:
            self._land(handle)

    def _land(self, handle: list) -> None:
        if handle in self.pending:
            self.pending.remove(handle)
            super().restore_blocks(handle[0])


def make(model, device_tokens: int, host_blocks: int, max_seqs: int = 4, late: bool = False,
         async_scheduling: bool = True):
    engine = (LateRestores if late else ReferenceEngine)(model, max_tokens=device_tokens, block_size=BLOCK,
                                                         max_seqs=max_seqs)
    host = HostTier(engine, host_blocks, BLOCK) if host_blocks else None
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=256, max_model_len=256,
                             async_scheduling=async_scheduling)
    return Scheduler(engine, frozenset(), config, host=host), host


def finish(scheduler, requests: list[EngineRequest]) -> dict[str, list]:
    for request in requests:
        scheduler.add(request)
    made = drain(scheduler)
    return {r.request_id: [(t.token_id, t.logprobs, t.num_cached_tokens) for t in made[r.request_id]]
            for r in requests}


def request(name: str, prompt: list[int], tokens: int = 6) -> EngineRequest:
    return EngineRequest(name, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=3))


def test_an_evicted_prefix_comes_back_from_host_blocks_with_a_cold_runs_tokens(model):
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 500, 64).tolist()  # 16 blocks: the device pool holds 20
    first = request("first", shared + [1, 2, 3])
    filler = request("filler", rng.integers(0, 500, 70).tolist())  # evicts the shared prefix from the device
    second = request("second", shared + [7, 8])
    scheduler, host = make(model, device_tokens=80, host_blocks=64)
    finish(scheduler, [first])
    finish(scheduler, [filler])
    assert host.offloaded >= 16
    found = finish(scheduler, [second])["second"]
    assert found[0][2] == 64  # the whole prefix counted cached: only the tail computed
    assert host.restored >= 12  # most of it from host blocks (the device may still hold its head)
    cold, _ = make(model, device_tokens=4096, host_blocks=0)
    expected = finish(cold, [request("second", shared + [7, 8])])["second"]
    assert [t for t, _, _ in found] == [t for t, _, _ in expected]
    for (_, mine, _), (_, theirs, _) in zip(found, expected):
        np.testing.assert_allclose(list(mine.values()), list(theirs.values()), rtol=1e-4, atol=1e-4)  # chunking


@pytest.mark.parametrize("late", [False, True])
def test_both_tiers_under_pressure_with_aborts_give_every_request_its_own_output(model, late):
    """40 requests over 3 random prefixes, some aborted after a step or two; a device pool of 24 blocks and a host
    tier of 12, so blocks pass down, back up and out of both. `late`: copies back land steps later (a GPU's side
    stream), so requests wait for them, their own or another's, and some are aborted meanwhile."""
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(0, 500, int(n)).tolist() for n in (24, 36, 16)]
    work = [request(f"r{i}", prefixes[i % 3] + rng.integers(0, 500, int(rng.integers(1, 9))).tolist(),
                    int(rng.integers(2, 8))) for i in range(40)]
    aborted = {f"r{i}" for i in rng.choice(40, 8, replace=False)}
    scheduler, host = make(model, device_tokens=96, host_blocks=12, max_seqs=3, late=late)
    for r in work:
        scheduler.add(r)
    restoring_aborted = 0
    out: dict[str, list[int]] = {r.request_id: [] for r in work}
    steps = 0
    while scheduler.has_work():
        for token in scheduler.step():
            out[token.request_id].append(token.token_id)
        steps += 1
        doomed = [n for n in aborted if out[n]]  # an aborted request goes after its first token
        if late and steps % 2:  # and, every other step, one waiting for its host blocks
            doomed += [n for n, state in scheduler._states.items() if state.restoring and n not in doomed][:1]
        for name in doomed:
            restoring_aborted += bool(scheduler._states[name].restoring)
            scheduler.abort(name)
            aborted.discard(name)
    assert host.restored > 0 and host.offloaded > host.capacity
    if late:
        assert scheduler.engine.waits > 0 and restoring_aborted > 0 and not scheduler.engine.pending
    for r in work:
        cold, _ = make(model, device_tokens=4096, host_blocks=0)
        (alone,) = finish(cold, [request(r.request_id, r.prompt_ids, r.params.max_tokens)]).values()
        expected = [t for t, _, _ in alone]
        assert out[r.request_id] == expected[:len(out[r.request_id])], r.request_id
    cache, allocator = scheduler.cache, scheduler.allocator
    assert allocator.num_free + cache.num_evictable == allocator.num_blocks  # device: every block free or cached
    assert host.used <= host.capacity and not host.pinned  # host: every block cached, none left pinned


@pytest.mark.parametrize("late", [False, True])
def test_async_scheduling_restores_from_the_host_as_plain_steps_do(model, late):
    """Steps launched before the last one is read: copies down and back still follow the steps queued before them
    (the device's stream order; here, the order of the calls), and every request gets the plain steps' tokens."""
    rng = np.random.default_rng(1)
    prefixes = [rng.integers(0, 500, int(n)).tolist() for n in (24, 36, 16)]
    work = [request(f"r{i}", prefixes[i % 3] + rng.integers(0, 500, int(rng.integers(1, 9))).tolist(),
                    int(rng.integers(2, 8))) for i in range(24)]
    outputs, launched_ahead = [], 0
    for overlap in (False, True):
        scheduler, host = make(model, device_tokens=96, host_blocks=12, max_seqs=3, late=late,
                               async_scheduling=overlap)
        for r in work:
            scheduler.add(r)
        made: dict[str, list[int]] = {r.request_id: [] for r in work}
        while scheduler.has_work():
            for token in scheduler.step():
                made[token.request_id].append(token.token_id)
            launched_ahead += scheduler.in_flight
        outputs.append(made)
        assert host.restored > 0 and (scheduler.overlap is not None) == overlap
    assert outputs[0] == outputs[1]
    assert launched_ahead > 10


def test_a_preempted_sequence_needing_the_blocks_a_restoring_request_holds_is_not_stuck_behind_it(model):
    """A long decode fills the pool while a request's host blocks come back slowly: the decode is preempted and
    goes back ahead of the restoring request, and fits only once that request lets its blocks go; both finish."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 500, 16).tolist()
    engine = LateRestores(model, max_tokens=80, block_size=BLOCK, max_seqs=4, polls=10)
    scheduler = Scheduler(engine, frozenset(), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                                               max_model_len=256), host=HostTier(engine, 64, BLOCK))
    finish(scheduler, [request("first", prefix + [1])])
    finish(scheduler, [request("filler", rng.integers(0, 500, 76).tolist(), 2)])  # the prefix goes to the host
    scheduler.add(request("long", rng.integers(0, 500, 24).tolist(), 48))
    while len(scheduler._states["long"].seq.table.blocks) < 15:
        scheduler.step()
    scheduler.add(request("restoring", prefix + [9]))
    made = {"long": [], "restoring": []}
    for _ in range(200):
        for token in scheduler.step():
            made[token.request_id].append(token.token_id)
        if not scheduler.has_work():
            break
    assert not scheduler.has_work() and scheduler.stats.preemptions > 0 and engine.waits > 0
    assert len(made["restoring"]) == 6


def test_a_block_is_copied_down_once_idle_and_only_settled_when_evicted():
    """The copy down happens when the last sequence lets a cached block go, long before the pool evicts it (so a
    GPU's copy overlaps the steps between); held again and let go, it is not copied twice; evicted, it is settled
    (later steps may write it), not copied."""
    from pegainfer.runtime.kv_blocks import BlockAllocator, BlockTable
    from pegainfer.runtime.prefix_cache import PrefixCache, chain_hashes

    class Copies:
        def __init__(self) -> None:
            self.calls = []

        def allocate_host_blocks(self, host_blocks: int) -> None:
            pass

        def offload_block(self, device_block: int, host_block: int) -> None:
            self.calls.append(("down", device_block))

        def settle_block(self, device_block: int) -> None:
            self.calls.append(("settle", device_block))
    copies = Copies()
    host = HostTier(copies, 4, BLOCK)
    allocator = BlockAllocator(num_blocks=8, block_size=BLOCK)
    cache = PrefixCache(allocator, host.settle, host.keep)
    table = BlockTable()
    allocator.grow(table, 2 * BLOCK)
    first, second = table.blocks
    for block, block_hash in zip(table.blocks, chain_hashes(list(range(2 * BLOCK)), BLOCK)):
        cache.insert(block, block_hash)
    assert copies.calls == []
    cache.release(table.blocks)
    assert copies.calls == [("down", second), ("down", first)] and host.offloaded == 2
    cache.acquire([first])
    cache.release([first])
    assert host.offloaded == 2
    copies.calls.clear()
    cache.evict(2)
    assert copies.calls == [("settle", second), ("settle", first)] and host.used == 2


def test_a_full_tier_drops_a_copy_the_device_still_caches_before_one_only_it_holds():
    """With copies down at idle, a full tier would otherwise trade blocks only the host holds for twins of blocks
    still on the device (a prompt that evicted a prefix, finishing, would push the prefix out of the host too)."""
    from pegainfer.runtime.kv_blocks import BlockAllocator, BlockTable
    from pegainfer.runtime.prefix_cache import PrefixCache, chain_hashes

    class Copies:
        def allocate_host_blocks(self, host_blocks: int) -> None:
            pass

        def offload_block(self, device_block: int, host_block: int) -> None:
            pass

        def settle_block(self, device_block: int) -> None:
            pass

        def restore_seconds(self) -> float:
            return 0.0
    host = HostTier(Copies(), 2, BLOCK)
    allocator = BlockAllocator(num_blocks=8, block_size=BLOCK)
    cache = PrefixCache(allocator, host.settle, host.keep)
    prefix, other, late = (chain_hashes(list(range(s, s + BLOCK)), BLOCK)[0] for s in (0, 100, 200))
    for block_hash in (prefix, other, late):
        table = BlockTable()
        allocator.grow(table, BLOCK)
        cache.insert(table.blocks[0], block_hash)
        cache.release(table.blocks)  # idle: copied down
        if block_hash == prefix:
            cache.evict(1)  # the prefix now lives on the host only
    assert host.lookup(list(range(BLOCK)), 0, b"", 1) == [prefix]  # kept; `other`, the device's twin, made room
    assert host.lookup(list(range(100, 100 + BLOCK)), 0, b"", 1) == []


def test_a_tier_past_the_hosts_memory_is_refused_with_the_numbers():
    with pytest.raises(PegainferError, match=r"--kv-offload-gb 64 asks for 64.0 GiB of host memory; 8.0 GiB is "
                                             r"available"):
        host_capacity(64, 4096, available=8 * GIB)
    assert host_capacity(1, 4096, available=8 * GIB) == GIB // 4096


def test_serve_restores_a_prefix_from_the_host_tier_and_counts_it(tiny_checkpoint, tmp_path):
    import subprocess
    import sys

    from live_server import NAME, start_server, stop_server

    server = start_server(tiny_checkpoint, "--kv-cache-tokens", "512", "--kv-offload-gb", "0.01",
                          log=tmp_path / "serve.log")
    try:
        rng = np.random.default_rng(2)
        shared, filler = rng.integers(3, 500, 320).tolist(), rng.integers(3, 500, 400).tolist()  # 20, 25 blocks
        client = server.client()
        answers = [client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0,
                                             extra_body={"ignore_eos": True})
                   for prompt in (shared + [1], filler, shared + [2])]
        metrics = server.metrics()
        assert metrics["pegainfer:host_kv_restored_blocks_total"] > 0
        assert answers[2].usage.prompt_tokens_details.cached_tokens == 320
        assert metrics["pegainfer:host_kv_hit_tokens_total"] >= 160  # the rest still on the device
        assert "host KV tier of" in server.log.read_text()
    finally:
        stop_server(server)
    refused = subprocess.run([sys.executable, "-m", "pegainfer.cli", "serve", "--model-path", str(tiny_checkpoint),
                              "--device", "cpu", "--kv-offload-gb", "100000"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode != 0
    assert "--kv-offload-gb 100000 asks for 100000.0 GiB of host memory" in refused.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("layout", ["even", "uneven"])
def test_gpu_host_blocks_copy_down_and_back_on_side_streams(monkeypatch, layout):
    """runtime/gpu/host_blocks.py over a stand-in driver whose device memory is a byte array: a block copied down
    and back into another device block carries every paged state's bytes of it and touches no other block. Copies
    down run on one side stream and copies back on another, each after the steps queued before them, and after
    each other only where they share a block; the step stream waits for one only once its device block is evicted,
    and not after it has finished. States of one size at one stride move in one 2D copy a block, others in a copy
    each; restores are timed by their events, which say when they have landed."""
    from pegainfer.ir.dtypes import BF16, FP32
    from pegainfer.runtime.cuda import driver
    from pegainfer.runtime.gpu.abi import DeviceTensor
    from pegainfer.runtime.gpu.host_blocks import HostBlocks

    device = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    calls = []

    def to_host(dst: np.ndarray, src: int, stream=None) -> np.ndarray:
        calls.append(("copy", stream))
        dst[:] = device[src:src + dst.nbytes]
        return dst

    def to_device(dst: int, src: np.ndarray, stream=None) -> None:
        calls.append(("copy", stream))
        device[dst:dst + src.nbytes] = src

    def rows(host: np.ndarray, at: int, pitch: int, count: int, down: bool, stream) -> None:
        calls.append(("copy", stream))
        width = host.nbytes // count
        for row in range(count):
            span = slice(at + row * pitch, at + row * pitch + width)
            if down:
                host[row * width:(row + 1) * width] = device[span]
            else:
                device[span] = host[row * width:(row + 1) * width]

    class Event:
        """Its clock: the copies queued before it was recorded, a millisecond each; finished when told."""
        finished = False

        def __init__(self, timing: bool = True) -> None:
            pass

        def record(self, stream) -> None:
            calls.append(("record", stream))
            self.at = sum(kind == "copy" for kind, _ in calls)

        def wait(self, stream) -> None:
            calls.append(("wait", stream))

        def done(self) -> bool:
            return Event.finished

        def seconds_since(self, start) -> float:
            return (self.at - start.at) / 1e3
    for name, stand_in in (("copy_to_host", to_host), ("copy_to_device", to_device), ("copy_rows", rows),
                           ("alloc_pinned", lambda n: np.zeros(n, np.uint8)), ("Event", Event),
                           ("new_stream", iter(["down", "up"]).__next__)):
        monkeypatch.setattr(driver, name, stand_in)
    if layout == "even":  # K and V of two layers, 8 blocks of 128 bytes each, 1024 bytes apart
        paged = {f"s{i}": DeviceTensor.contiguous(1024 * i, (8, 4, 2, 8), BF16) for i in range(4)}
        spans, per_block = [(1024 * i, 128) for i in range(4)], 1
    else:
        paged = {"k": DeviceTensor.contiguous(0, (8, 4, 2, 8), BF16),  # 128 bytes a block
                 "v": DeviceTensor.contiguous(4096, (8, 4, 1, 16), FP32)}  # 256
        spans, per_block = [(0, 128), (4096, 256)], 2
    blocks = HostBlocks("step", paged, capacity=2)
    before = device.copy()
    down = [("record", "step"), ("wait", "down"), *[("copy", "down")] * per_block, ("record", "down")]

    blocks.offload(3, 1)
    blocks.offload(5, 0)
    assert calls == down * 2
    calls.clear()
    blocks.settle(3)  # evicted while its copy is in flight: the next steps wait for it
    device[:] = 0
    ticket = blocks.restore([(1, 7), (0, 2)])  # host blocks 1 and 0 still being written: waited for, each once
    assert calls == [("wait", "step"), ("record", "step"), ("wait", "up"), ("wait", "up"), ("wait", "up"),
                     ("record", "up"), *[("copy", "up")] * 2 * per_block, ("record", "up")]
    calls.clear()
    blocks.offload(4, 1)  # host block 1 being read back: the copy down into it waits for that restore
    assert calls == [("record", "step"), ("wait", "down"), ("wait", "down"), *[("copy", "down")] * per_block,
                     ("record", "down")]
    assert not blocks.landed(ticket)
    calls.clear()
    blocks.settle(2)  # evicted before its copy back landed (its request aborted): the next steps wait for it
    assert calls == [("wait", "step")]
    Event.finished = True
    assert blocks.landed(ticket)
    assert blocks.restore_seconds() == pytest.approx(2 * per_block / 1e3)  # the restores' copies, timed
    for base, size in spans:
        block = lambda i, memory: memory[base + i * size:base + (i + 1) * size]  # noqa: E731
        assert np.array_equal(block(7, device), block(3, before))
        assert np.array_equal(block(2, device), block(5, before))
        assert not any(block(i, device).any() for i in (0, 1, 3, 4, 5, 6))
    blocks.offload(6, 1)  # the earlier copies have finished: nothing waits for them any more
    calls.clear()
    blocks.settle(5)
    blocks.settle(7)
    assert calls == [] and blocks.landed(ticket)  # its events read, and reused by the next restore
    Event.finished = False
    calls.clear()
    later = blocks.restore([(0, 4)])  # the copy down into host block 1 in flight: another block's, not waited for
    assert calls == [("record", "step"), ("wait", "up"), ("record", "up"), *[("copy", "up")] * per_block,
                     ("record", "up")]
    assert not blocks.landed(later) and blocks.landed(ticket)
