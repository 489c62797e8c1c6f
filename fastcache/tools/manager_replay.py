"""The scheduler-side manager's cost, recorded in a vLLM run and replayed against two managers in one process.

`Recorder` wraps the OffloadingManager of a running vLLM engine: it times every call the connector's
scheduler makes and keeps the call with its keys. `replay` feeds the same calls, in the same order and
with the same keys, to a fresh fastcache `FastcacheManager` and to vLLM's own `CPUOffloadingManager` (LRU)
of the same capacity, timing each; a step ends at `on_schedule_end`, which vLLM calls once per scheduler
step. Both see the calls as the scheduler would issue them to that manager: a store completes the keys that
manager itself chose to store, and a load asks only for keys that manager reports as hits.
"""
from __future__ import annotations

import time

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from ..integrations.vllm.manager import FastcacheManager

TIMED = ("lookup", "prepare_load", "touch", "complete_load", "prepare_store", "complete_store",
         "on_new_request", "on_request_finished")


class Recorder:
    """Stands in for the engine's manager: every call goes through, timed, and is kept for the replay.

    A kept call is (method, request id, keys, success, ref); None marks a step's end. ref links a
    complete_store or complete_load to the index of the prepare call whose keys it completes."""

    def __init__(self, manager):
        self._manager = manager
        self.reset()

    def reset(self):
        """Forget what was kept (a warm-up's calls): a job prepared before completes unlinked, never as a
        later call's."""
        self.calls = []
        self.step_seconds = [0.0]   # the manager's time in each scheduler step
        self.l3_fetches = 0         # keys a load first fetched from the store (fastcache with L3)
        self.loaded_keys = 0        # keys the scheduler loaded
        self._open = {}             # (kind, request id, keys) -> index of the prepare call

    def __getattr__(self, name):
        target = getattr(self._manager, name)
        if name == "on_schedule_end":
            def step_end(*args, **kwargs):
                self.calls.append(None)
                self.step_seconds.append(0.0)
                return target(*args, **kwargs)
            return step_end
        if name not in TIMED:
            return target

        def timed(*args, **kwargs):
            began = time.perf_counter()
            out = target(*args, **kwargs)
            self.step_seconds[-1] += time.perf_counter() - began
            self._keep(name, args, kwargs, out)
            return out
        return timed

    def _keep(self, name, args, kwargs, out):
        if name in ("on_new_request", "on_request_finished"):
            self.calls.append((name, args[0].req_id, (), True, None))
            return
        keys, context = args[0], args[1] if len(args) > 1 else kwargs["req_context"]
        keys = (keys,) if name == "lookup" else tuple(keys)
        success = args[2] if len(args) > 2 else kwargs.get("success", True)
        req, ref = context.req_id, None
        # vLLM completes a job with the set of its keys: match them as sets
        if name == "prepare_store" and out is not None:
            self._open[("store", req, frozenset(out.keys_to_store))] = len(self.calls)
        elif name == "prepare_load":
            self._open[("load", req, frozenset(keys))] = len(self.calls)
            self.loaded_keys += len(keys)
            self.l3_fetches += int(np.count_nonzero(getattr(out, "fetch", ())))
        elif name in ("complete_store", "complete_load"):
            kind = "store" if name == "complete_store" else "load"
            ref = self._open.pop((kind, req, frozenset(keys)), None)
        self.calls.append((name, req, keys, success, ref))


class AllStamped:
    """ManagerLinks for a replay: every rank stamped every chunk (no workers run here)."""

    def stamped(self, chunks, stamps):
        return np.ones(len(chunks), dtype=bool)

    def close(self):
        pass


def fastcache_manager(num_chunks: int, blocks_per_chunk: int) -> FastcacheManager:
    return FastcacheManager(num_chunks, blocks_per_chunk, AllStamped(), world_size=1, policy="lru")   # like for like


def vllm_lru_manager(num_chunks: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(num_chunks, cache_policy="lru")


def replay(calls, manager) -> dict:
    """The recorded calls against `manager`: its seconds per scheduler step, and its lookups and loads."""
    contexts, chosen = {}, {}        # chosen: prepare call index -> the keys this manager took
    steps, current, loaded, lookups, hits = [], 0.0, 0, 0, 0
    for index, call in enumerate(calls):
        if call is None:
            steps.append(current)
            current = 0.0
            continue
        name, req_id, keys, success, ref = call
        context = contexts.get(req_id)
        if context is None:
            context = contexts[req_id] = ReqContext(req_id=req_id)
        if name == "prepare_load":       # only what this manager holds: a scheduler asks for nothing else
            keys = tuple(k for k in keys if manager.lookup(k, context) == LookupResult.HIT)
            chosen[index] = keys
            if not keys:
                continue
            loaded += len(keys)
        elif name in ("complete_load", "complete_store"):
            keys = chosen.pop(ref, ())
            if not keys:
                continue
        began = time.perf_counter()
        if name in ("on_new_request", "on_request_finished"):
            getattr(manager, name)(context)
        elif name == "lookup":
            found = manager.lookup(keys[0], context)
        elif name == "complete_store":
            manager.complete_store(keys, context, success)
        else:
            out = getattr(manager, name)(keys, context)
        current += time.perf_counter() - began
        if name == "lookup":
            lookups += 1
            hits += found == LookupResult.HIT
        elif name == "prepare_store" and out is not None:
            chosen[index] = tuple(out.keys_to_store)
    if current or not steps:        # calls after the last step's end count with that step
        if steps:
            steps[-1] += current
        else:
            steps.append(current)
    steps = np.asarray(steps)
    return {"steps": len(steps), "mean_us": float(steps.mean() * 1e6),
            "p90_us": float(np.percentile(steps, 90) * 1e6), "total_ms": float(steps.sum() * 1e3),
            "lookups": lookups, "lookup_hits": int(hits), "loaded_keys": loaded}
