"""The adapters a server holds and the slots of the LoRA tables they occupy (frontends/lora.py): adapters are read
into host memory when registered; a request's adapter is written into a slot of the engine's tables when a
sequence of it is admitted, and stays while any sequence holds it; a slot no sequence holds is reused, least
recently used first, when another adapter needs one."""

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from pegainfer.errors import RequestError
from pegainfer.frontends.lora import Adapter, LoraConfig, adapter_rows
from pegainfer.ir.graph import Graph

Writer = Callable[[int, dict[str, np.ndarray]], None]  # an engine's: rows of every table into one slot


class LoraSlots:
    def __init__(self, graph: Graph, config: LoraConfig, write: Writer) -> None:
        self.graph, self.config, self.write = graph, config, write
        self.adapters: dict[str, Adapter] = {}
        self._keys: dict[str, str] = {}
        self._slot_of: dict[str, int] = {}
        self._name_of: list[str | None] = [None] * config.max_loras
        self._refs = [0] * config.max_loras
        self._idle: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(config.max_loras))
        self.loads = 0  # adapters written into a slot
        self._empty: dict[str, np.ndarray] | None = None  # the rows of no adapter, built once
        self._registered = 0  # adapters registered so far: each one's number keys its prefix-cache blocks

    def register(self, adapter: Adapter) -> None:
        if adapter.name in self.adapters:
            raise RequestError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        self.adapters[adapter.name] = adapter
        self._registered += 1
        self._keys[adapter.name] = f"{adapter.name}\0{self._registered}"

    def cache_key(self, name: str) -> str:
        """What keys the prefix-cache blocks of this load of `name` (a later load under the name gets another)."""
        return self._keys[name]

    def unregister(self, name: str) -> None:
        """Drops an adapter no sequence holds (its slot, if any, emptied)."""
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            assert self._refs[slot] == 0, f"adapter {name} is held by {self._refs[slot]} sequences"
            self._name_of[slot] = None
            if self._empty is None:
                self._empty = adapter_rows(None, self.graph)
            self.write(slot, self._empty)
        del self.adapters[name], self._keys[name]

    def acquire(self, name: str) -> int | None:
        """The slot holding `name` for one more sequence, written there first if needed; None while every slot
        is held by sequences of other adapters."""
        slot = self._slot_of.get(name)
        if slot is None:
            if not self._idle:
                return None
            slot, _ = self._idle.popitem(last=False)
            previous = self._name_of[slot]
            if previous is not None:
                del self._slot_of[previous]
            self.write(slot, adapter_rows(self.adapters[name], self.graph))
            self._name_of[slot], self._slot_of[name] = name, slot
            self.loads += 1
        self._idle.pop(slot, None)
        self._refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self._refs[slot] -= 1
        assert self._refs[slot] >= 0, f"LoRA slot {slot} released more often than acquired"
        if self._refs[slot] == 0:
            self._idle[slot] = None
