"""Adapters in host memory, by lora_int_id: loaded and checked once, least recently used evicted.

The engine adds an adapter when a request names it (or through add_lora), so a bad adapter is
refused at the request, before anything is scheduled; the runner takes the checked copy from here
when a request is admitted to a row. An adapter evicted from host memory while requests still name
it is read again from its path when the runner next needs it.
"""

from collections import OrderedDict
from typing import Optional

from tokenmill.errors import LoRAError
from tokenmill.logger import init_logger
from tokenmill.lora.adapter import LoRAAdapter, ModuleShapes, describe, load_adapter
from tokenmill.lora.request import LoRARequest

logger = init_logger(__name__)


class LoRARegistry:
    def __init__(self, shapes: ModuleShapes, max_rank: int, max_cpu_loras: int):
        self.shapes = shapes
        self.max_rank = max_rank
        self.capacity = max_cpu_loras
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._known: dict[int, LoRARequest] = {}  # every id in use, loaded or not: one adapter per id

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The checked adapter of `request`, read from disk unless already in memory; LoRAError if
        it is bad or its id already names another adapter."""
        known = self._known.get(request.lora_int_id)
        if known is not None and known != request:
            raise LoRAError(f"lora_int_id {request.lora_int_id} already names LoRA adapter {known.lora_name!r} "
                            f"at {known.lora_path!r}; give {request.lora_name!r} an id of its own")
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is not None:
            self._adapters.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.shapes, self.max_rank)
        logger.info("loaded %s from %s", describe(adapter), request.lora_path)
        self._known[request.lora_int_id] = request
        self._adapters[request.lora_int_id] = adapter
        while len(self._adapters) > self.capacity:
            old_id, old = self._adapters.popitem(last=False)
            logger.debug("host memory: evicted LoRA adapter %r (id %d)", old.request.lora_name, old_id)
        return adapter

    def weights_for(self, request: LoRARequest) -> LoRAAdapter:
        """For the runner, admitting a request that names `request`: its adapter from memory, else
        read again (and kept only if the id is still registered: a removed adapter serves the
        requests that were already queued, and is not registered again by them)."""
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is not None and adapter.request == request:
            self._adapters.move_to_end(request.lora_int_id)
            return adapter
        if self._known.get(request.lora_int_id) == request:
            return self.add(request)
        return load_adapter(request, self.shapes, self.max_rank)

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter (requests already admitted keep running with it); False if unknown."""
        self._adapters.pop(lora_int_id, None)
        return self._known.pop(lora_int_id, None) is not None

    def get(self, lora_int_id: int) -> Optional[LoRARequest]:
        return self._known.get(lora_int_id)

    def ids(self) -> list[int]:
        return sorted(self._known)

    def num_in_memory(self) -> int:
        return len(self._adapters)
