"""SwapBackend: the engine side of fastcache (docs/design.md §1, §4-§7).

It creates the deployment's signals, phase barrier, CPU tiers and task queue, turns swap requests into
validated tasks, and starts and closes the deployment. Its parts, each in its own module and each the one
owner of its state: the rank supervisor (ranks.py: the transfer managers' processes), the task channel
(channel.py: the pipes, the I/O thread, the tasks in flight and the phase reports), the CPU tiers
(cpu_tiers.py), the phases (phases.py: clear/restore, sleep/wake, readiness and the phase lock), the store
tasks (store_tasks.py), the weight group (weights.py) and the resharder (resharder.py); its rank, phase,
store, weight and reshard methods delegate to them, and the parts know each other only through public
methods and callables given in their constructors. The resharder reaches the ranks' state through a
BackendReshardHost (reshard_host.py), which calls the parts' public methods.
"""
from __future__ import annotations

import itertools
import logging
import time

import numpy as np

from ..config import CacheSpec, Settings
from ..errors import RefusedError, TransferError
from ..ipc import protocol
from ..ipc.barrier import ENGINE_PARTY, phase_barrier
from ..ipc.layers import SlotClaims
from ..ipc.leftovers import remove_dead
from ..ipc.naming import new_suffix
from ..ipc.reaper import Reaper
from ..ipc.queue import make_socket_dir, new_token, remove_socket_dir
from ..ipc.shm import check_shm_room
from ..ipc.signal import NORMAL, STATUS_NAMES, DeploymentSignals, ReadyView
from ..metrics import SwapCounters
from ..ops import resolve_device
from ..reshard_plan import DEFAULT_STAGING_BYTES
from ..store import StoreURL
from ..weight_spec import DEFAULT_RING_SLOTS, WeightSpec
from ..worker.cache_worker import close_local_workers
from .allocator import CpuBlockAllocator
from .channel import TaskChannel
from .cpu_tiers import CpuTiers
from .handle import TransferHandle
from .ids import SMALL_IDS, as_ids, small_swap_ids, wire_dtype
from .phases import Phases
from .ranks import RankSupervisor
from .reshard_host import BackendReshardHost
from .resharder import Resharder
from .store_tasks import StoreTasks
from .submit_gate import SubmitGate
from .weights import WeightGroup, place_weights

log = logging.getLogger("fastcache.engine")

CLOSE_TIMEOUT = 30.0        # seconds SwapBackend.close() takes at most by default
STOP_GRACE = 5.0            # of which the transfer managers get this long to stop before they are killed


class SwapBackend:
    """The engine's handle on a deployment: `with SwapBackend(spec, tp_size=2, device="sim") as b: ...`

    weights (a WeightSpec) adds the model's weights as a tensor group (docs/design.md §11); offload_fraction
    (of the layers) or weight_budget (device bytes for weights) places them, the rest streaming through a
    ring of ring_slots device slots."""

    def __init__(self, spec: CacheSpec, tp_size: int = 1, device: str = "auto", suffix: str | None = None,
                 settings: Settings | None = None, device_ids=None, store: str | None = None,
                 weights: WeightSpec | None = None, offload_fraction: float | None = None,
                 weight_budget: int | None = None, ring_slots: int = DEFAULT_RING_SLOTS):
        # Checked first, so that a bad FASTCACHE_* value is refused before anything is created. The
        # environment is checked even when `settings` is given: the transfer managers spawned read it.
        env_settings = Settings.from_env()
        if not isinstance(spec, CacheSpec):
            raise ValueError(f"spec must be a CacheSpec, got {type(spec).__name__}")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
        self.spec, self.tp_size = spec, tp_size
        self.device = resolve_device(device)
        self.suffix = suffix or new_suffix()
        self.settings = settings or env_settings
        self.device_ids = list(device_ids) if device_ids is not None else list(range(tp_size))
        if len(self.device_ids) != tp_size:
            raise ValueError(f"device_ids lists {len(self.device_ids)} devices for tp_size {tp_size}")
        self._check_fits()
        self._weights = WeightGroup(                # docs/design.md §11 (engine/weights.py)
            place_weights(weights, offload_fraction, weight_budget, ring_slots, tp_size, self.device,
                          self.device_ids),
            self.suffix, lambda: self.tp_size, lambda: self.signals, self._new_task, self._new_phase_task,
            self._send_task)
        # held by a swap from its status check until it is sent: a reshard waits for it
        self._submissions = SubmitGate(self._refuse_unless_normal)
        # L3 (docs/design.md §8); made here so that a bad store URL is refused before anything starts
        self._store_tasks = StoreTasks(store, lambda: (self.spec, self.tp_size), self._new_task, self._send_task,
                                       lambda: self._closed, self._submissions)
        self.allocator = CpuBlockAllocator(spec.num_cpu_blocks)
        self.counters = SwapCounters()              # exported by fastcache.metrics
        self._task_ids = itertools.count(1)
        self._layer_slots = SlotClaims("a layer-by-layer swap-in")     # ipc/layers.py (weight streams: weights.py)
        self._token = new_token()                   # signs every message (ipc/queue.py); never sent
        self._ranks = RankSupervisor(               # docs/design.md §7 (engine/ranks.py)
            tp_size, self.settings, self._token,
            lambda: (self.spec, self.tp_size, self.device_ids, self.weight_layout), self._launch_args,
            lambda: self.signals, lambda rank, incarnation: self._channel.open_pipe(rank, incarnation),
            lambda rank, why: self._channel.fail_rank_tasks(rank, why), lambda: self._channel.wake())
        self._channel = TaskChannel(                # docs/design.md §4 (engine/channel.py)
            self._token, self.settings, lambda: self.signals, lambda: self.barrier, self._ranks, lambda: self._closed)
        self._tiers = CpuTiers(tp_size, self.suffix)   # docs/design.md §3 (engine/cpu_tiers.py)
        self._phases = Phases(                      # docs/design.md §6, §11 (engine/phases.py)
            self.settings, lambda: self.signals, lambda: self.barrier, lambda: self.tp_size, lambda: self.spec,
            self._ranks, self._channel, self._weights, self._tiers, self.allocator, lambda: self._resharder.pending,
            lambda deadline: self._resharder.wait_caches_quiet(deadline, "clear"),
            lambda deadline: self._submissions.wait_idle(deadline - time.monotonic()), lambda: self.running)
        self._started = self._closed = False
        self.signals = self.barrier = self._reaper = None
        self._ready_view: ReadyView | None = None      # the signals _new_task reads, made on the first task
        self._resharder = Resharder(BackendReshardHost(      # docs/design.md §9 (engine/resharder.py)
            self, self._weights, self._phases, self._ranks, self._channel, self._tiers, self._take_geometry,
            self._submissions))

    # -- start-up --------------------------------------------------------------------------------
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def start(self):
        if self._started:
            return self
        remove_dead()
        self._started = True
        try:
            if self.settings.reaper:        # removes what this deployment leaves if this process is killed
                self._reaper = Reaper()
                self._reaper.watch(self.suffix)
            # room for every tp a reshard can reach (docs/design.md §9): the signals and the barrier stay
            self.signals = DeploymentSignals(self.suffix, self.tp_size, create=True, capacity=self.rank_capacity)
            for claims in ("layer_claims", "weight_claims"):
                SlotClaims.open(self.signals.whole(claims))
            self.barrier = phase_barrier(self.suffix, self.tp_size, create=True, capacity=self.rank_capacity)
            self.barrier.register(ENGINE_PARTY)
            self._tiers.create_all(self.spec, self.tp_size)
            self._weights.create_regions()
            self.socket_dir = make_socket_dir(self.suffix)
            self._channel.start(self.socket_dir, self.tp_size, self.suffix)
            for rank in range(self.tp_size):
                self._ranks.spawn(rank)
        except BaseException:
            self.close()
            raise
        return self

    def _launch_args(self) -> list[str]:
        """The arguments every transfer manager of this deployment is started with (engine/ranks.py)."""
        return ["--ipc_suffix", self.suffix, "--socket_dir", self.socket_dir, "--device", self.device] + \
            (["--store", self.store_url.url] if self.store_url else [])

    def _check_fits(self):
        """Refuse a spec that cannot fit before allocating anything (psutil / /dev/shm free space)."""
        need = self.tp_size * self.spec.cpu_cache_bytes
        if self.device == "sim":
            need += self.tp_size * self.spec.gpu_cache_bytes
        check_shm_room(need, f"the spec, for {self.tp_size} rank(s) (CPU tier"
                             f"{' and simulated GPU cache' if self.device == 'sim' else ''}; lower num_cpu_blocks or "
                             f"num_gpu_blocks),")

    @property
    def running(self) -> bool:
        """Started and not closed."""
        return self._started and not self._closed

    @property
    def status(self) -> int:
        return self.signals.status

    # -- the ranks' processes (docs/design.md §7; engine/ranks.py) ----------------------------------------
    @property
    def transfer_pids(self) -> list[int]:
        return self._ranks.pids(self.tp_size)

    @property
    def failed_ranks(self) -> dict[int, str]:
        """Ranks out of service, with why (restart_rank puts one back)."""
        return self._ranks.failed_ranks

    def restart_rank(self, rank: int, timeout: float = 30.0):
        """Replace rank's transfer manager (dead or not); the CPU tier, owned here, keeps every block. During a
        pending reshard, the ranks of both tps can be restarted (a new rank's with the new spec). TransferError if
        the backend is not running, or closes meanwhile (no process is started then)."""
        if not self.running:
            raise TransferError("the backend is not running")
        self._ranks.restart(rank, self._resharder.pending)
        if self._closed:
            raise TransferError(f"restart of rank {rank}: the backend was closed")
        # registered: it holds its barrier slot, so a later phase will not find the dead pid there;
        # attached too when the cache is up (in CLEARED it attaches on restore)
        ranks = self._ranks
        ready = (lambda: ranks.attached(rank)) if self.signals.status == NORMAL else (lambda: ranks.registered(rank))
        self._phases.wait_signals(ready, time.monotonic() + timeout, f"restart of rank {rank}")

    def wait_ready(self, timeout: float = 30.0):
        """Wait until every worker has exported its cache and every transfer manager has attached it.
        Raises TransferError as soon as a rank fails, TimeoutError (saying what is missing) at the timeout."""
        self._phases.wait_ready(timeout)
        return self

    # -- swaps -----------------------------------------------------------------------------------
    def swap_out(self, gpu_block_ids, cpu_block_ids, fence=None) -> TransferHandle:
        """Copy GPU blocks to CPU blocks on every rank. fence: what CacheWorker.fence(stream) returned on
        the ranks (one Fence, or one per rank; None entries and None are no fence): on a rank with one the
        copy starts only after the work its worker queued on that stream before the fence (docs/design.md §4)."""
        return self._submit(protocol.SWAP_TO_CPU, gpu_block_ids, cpu_block_ids, fence)

    def swap_in(self, gpu_block_ids, cpu_block_ids, layerwise: bool = False, fence=None) -> TransferHandle:
        """Copy CPU blocks back to GPU blocks on every rank. layerwise=True copies layer by layer in layer
        order and publishes each: `handle.wait_layer(i)` returns once layer i is in place, so a forward
        can start on layer 0 while later layers are still copying. fence: as swap_out's; the copy writes the
        destination blocks only after the work queued before the fence (a zeroing of them included)."""
        if not isinstance(layerwise, bool):
            raise ValueError(f"layerwise must be a bool, got {layerwise!r}")
        return self._submit(protocol.SWAP_TO_GPU, gpu_block_ids, cpu_block_ids, fence, layerwise=layerwise)

    def _submit(self, kind, gpu_block_ids, cpu_block_ids, fence=None, layerwise: bool = False) -> TransferHandle:
        fences = self.checked_fences(fence)
        self._submissions.enter("swap")         # the status before the geometry the ids are checked against
        try:
            spec = self.spec
            # a small request of valid ids is checked in plain Python (ids.py); anything else, valid or not,
            # by _validate
            ids = small_swap_ids(gpu_block_ids, cpu_block_ids, kind == protocol.SWAP_TO_CPU, spec.num_gpu_blocks,
                                 spec.num_cpu_blocks)
            if ids is None:
                ids = self._validate(kind, gpu_block_ids, cpu_block_ids)
            return self._submit_ids(kind, *ids, layerwise=layerwise, fence=fences)
        finally:
            self._submissions.leave()

    def _refuse_unless_normal(self, what: str):
        """The submit gate's check: _check_can_submit's refusal unless the deployment runs in NORMAL."""
        if not self._started or self._closed or self.signals.status != NORMAL:
            self._check_can_submit(what)

    def checked_fences(self, fence) -> list:
        """fence (as swap_out's: a Fence, a list of them with None entries, or None) as a list of Fences of
        distinct ranks of this deployment; ValueError otherwise."""
        if fence is None:
            return []
        items = [fence] if isinstance(fence, protocol.Fence) else list(fence) if isinstance(fence, (list, tuple)) \
            else None
        if items is None:
            raise ValueError(f"fence must be what CacheWorker.fence() returned (or a list of them), got "
                             f"{type(fence).__name__}")
        items = [f for f in items if f is not None]
        for f in items:
            if not isinstance(f, protocol.Fence) or not 0 <= f.rank < self.tp_size or f.generation <= 0 or \
                    not 0 <= f.slot < protocol.FENCE_SLOTS:
                raise ValueError(f"fence {f!r} is not a fence of a rank of this deployment (CacheWorker.fence())")
        if len({f.rank for f in items}) != len(items):
            raise ValueError("two fences for one rank")
        return items

    def submit_checked_swap(self, kind, gpu_ids: list[int], cpu_ids: list[int], fences=()) -> TransferHandle:
        """A swap of ids (and fences, from checked_fences) the caller has already checked as _validate does.
        TieredCache checks each request before it touches its index and names only CPU blocks it owns, so its
        swaps skip a second check (each transfer manager still checks every task it receives)."""
        if len(gpu_ids) <= SMALL_IDS:
            return self._submit_ids(kind, list(map(int, gpu_ids)), list(map(int, cpu_ids)), fence=fences)
        wire = wire_dtype(self.spec)
        return self._submit_ids(kind, np.array(gpu_ids, wire), np.array(cpu_ids, wire), fence=fences)

    def _submit_ids(self, kind, gpu_ids, cpu_ids, layerwise: bool = False, fence=()) -> TransferHandle:
        """gpu_ids, cpu_ids: checked ids, as wire-dtype arrays or (a small task) lists of Python ints."""
        slots = self._layer_slots if layerwise else None
        spec = self.spec
        handle = self._new_task(kind, spec.task_bytes(gpu_ids) * self.tp_size, "swap", slots)
        if layerwise:
            handle.publishes_layers(self.signals, range(self.tp_size), spec.total_layers, slots)
        if type(gpu_ids) is list:
            message = protocol.SmallTask(handle.task_id, kind, gpu_ids, cpu_ids, wire_dtype(spec) is np.int64,
                                         layerwise, fence)
        else:
            message = protocol.encode_task(handle.task_id, kind, gpu_ids, cpu_ids, layerwise, fence=fence)
        return self._send_task(handle, message)

    def _new_task(self, kind, nbytes: int, what: str, slots=None, claims: str = "layer_claims") -> TransferHandle:
        """The handle of a task about to be sent, once the deployment can take one: RefusedError while it is
        cleared, restored, resharded or not ready, TransferError if it is not running or a rank failed. A
        layer-by-layer task takes its id from `slots` (ipc/layers.py: no two unfinished ones share a slot)."""
        view, ranks = self._ready_view, self._ranks
        if not (view is not None and not self._closed and view.source is self.signals.cache_ready and
                view.tp == self.tp_size and view.all_set() and not ranks.any_failed() and ranks.all_attached(view.tp)) \
                and not self._ready_now():
            self._check_can_submit(what)
        task_id = next(self._task_ids) if slots is None else \
            slots.claim(getattr(self.signals, claims), range(self.tp_size), self._task_ids)
        return TransferHandle(task_id, kind, range(self.tp_size), nbytes, self.counters.record)   # fastcache.metrics

    def _ready_now(self) -> bool:
        """_check_can_submit's checks in one pass for the common case (running, NORMAL, no rank failed, every rank
        ready; _new_task makes them inline while its view of the signals is current): True means they all pass;
        False only means that _check_can_submit must look closer."""
        if not self._started or self._closed:
            return False
        view, tp = self._ready_view, self.tp_size
        if view is None or view.source is not self.signals.cache_ready or view.tp != tp:
            view = self._ready_view = ReadyView(self.signals, tp, self.weight_layout is not None)
        ranks = self._ranks
        return view.all_set() and not ranks.any_failed() and ranks.all_attached(tp)

    def _check_can_submit(self, what: str):
        """RefusedError while the deployment is cleared, restored, resharded or not ready, TransferError if it is
        not running or a rank failed."""
        if not self._started or self._closed:
            raise TransferError("the backend is not running")
        status = self.signals.status
        if status != NORMAL:
            raise RefusedError(f"{what} refused: kv_cache_status is {STATUS_NAMES.get(status, status)} "
                               f"(the cache is being cleared, restored or resharded)")
        self._ranks.raise_if_failed()
        if not self._phases.all_ready():
            raise RefusedError(f"{what} refused: deployment not ready ({self._phases.readiness()}); call wait_ready()")

    def _new_phase_task(self, kind, nbytes: int) -> TransferHandle:
        """The handle of a task that a phase sends outside NORMAL (a sleep's or a wake's weight copy)."""
        self._ranks.raise_if_failed()
        handle = TransferHandle(next(self._task_ids), kind, range(self.tp_size), nbytes)
        handle.add_done_callback(self.counters.record)
        return handle

    def _send_task(self, handle, message) -> TransferHandle:
        return self._channel.send_task(handle, message)

    def _validate(self, kind, gpu_block_ids, cpu_block_ids):
        gpu_ids = as_ids(gpu_block_ids, "gpu_block_ids")
        cpu_ids = as_ids(cpu_block_ids, "cpu_block_ids")
        if len(gpu_ids) != len(cpu_ids):
            raise ValueError(f"gpu_block_ids has {len(gpu_ids)} ids but cpu_block_ids has {len(cpu_ids)}")
        if not 0 < len(gpu_ids) <= protocol.MAX_IDS:
            raise ValueError(f"a swap moves 1..{protocol.MAX_IDS} blocks, got {len(gpu_ids)}")
        protocol.check_ids(gpu_ids, cpu_ids, kind, self.spec.num_gpu_blocks, self.spec.num_cpu_blocks)
        wire = wire_dtype(self.spec)
        return gpu_ids.astype(wire), cpu_ids.astype(wire)

    # -- the store (docs/design.md §8; engine/store_tasks.py) ---------------------------------------------
    @property
    def store_url(self) -> StoreURL | None:
        """The store this deployment's transfer managers put to and fetch from (None without one)."""
        return self._store_tasks.url

    def cpu_to_store(self, namespace: str, hashes, cpu_block_ids) -> TransferHandle:
        """Put CPU block cpu_block_ids[i] of every rank into the store as the object of hashes[i]."""
        return self._store_tasks.cpu_to_store(namespace, hashes, cpu_block_ids)

    def store_to_cpu(self, namespace: str, hashes, cpu_block_ids) -> TransferHandle:
        """Fetch the object of hashes[i] of every rank into CPU block cpu_block_ids[i]. The handle fails
        (TransferError naming the store) if any object is missing or does not match its header; those
        CPU blocks then hold undefined bytes."""
        return self._store_tasks.store_to_cpu(namespace, hashes, cpu_block_ids)

    def store_contains(self, namespace: str, hashes) -> np.ndarray:
        """A bool per hash: does the store hold its object for every rank? (Existence only: a fetch still
        checks each header.) StoreError if the store does not answer within QUERY_TIMEOUT seconds."""
        return self._store_tasks.store_contains(namespace, hashes)

    def store_remove(self, namespace: str, hashes):
        """Remove the objects of these hashes, every rank's (absent ones are ignored)."""
        self._store_tasks.store_remove(namespace, hashes)

    def cpu_tier(self, rank: int) -> np.ndarray:
        """Rank's CPU tier as uint8 [num_cpu_blocks, cpu_block_bytes], a view of its blocks without their slots
        (block-major; for checks and tools)."""
        return self._tiers.blocks(rank, self.spec)

    def allocate_cpu_blocks(self, n: int) -> list[int]:
        return self.allocator.allocate(n)

    def free_cpu_blocks(self, ids):
        self.allocator.free(ids)

    # -- resharding (docs/design.md §9; engine/resharder.py) ----------------------------------------------
    def reshard(self, tp_size, live_blocks=None, start_workers=None, stop_workers=None, timeout: float = 120.0,
                *, device_ids=None, staging_bytes: int = DEFAULT_STAGING_BYTES):
        """Move every live block's KV head slices to the ranks that own them under tp_size (docs/design.md §9).

        Returns (new per-rank CacheSpec, block_map {old GPU id: new GPU id} of the live blocks). The CPU
        tier's used blocks survive too: `last_reshard["cpu_block_map"]` says where they went (the allocator
        and every TieredCache over this backend are remapped already). `start_workers(ranks, spec)` must start
        the workers of ranks that appear (for tp `backend.resharding.to_tp`), `stop_workers(ranks)` stop those
        that go. `device_ids`: the new ranks' devices (default: kept ranks keep theirs, new rank r gets r).
        ValueError for a bad request, before anything changes; TransferError if a rank fails (engine/resharder.py
        says what is left in service then)."""
        with self._phases.lock:
            return self._resharder.reshard(tp_size, live_blocks, start_workers, stop_workers, timeout,
                                           device_ids=device_ids, staging_bytes=staging_bytes)

    @property
    def last_reshard(self) -> dict | None:
        """The report of the last completed reshard."""
        return self._resharder.last_reshard

    @property
    def resharding(self):
        """The step in progress (a ReshardStep: start_workers may read it), None between steps."""
        return self._resharder.resharding

    @property
    def rank_capacity(self) -> int:
        """The most ranks this deployment can reshard to: its total KV heads, at most 31."""
        return self._resharder.rank_capacity

    def spec_at(self, tp_size: int) -> CacheSpec:
        """Each rank's CacheSpec after reshard(tp_size) from the current layout: its heads, and the GPU, draft and
        CPU blocks its memory holds then (docs/design.md §9); ValueError for a tp it cannot reach."""
        return self._resharder.spec_at(tp_size)

    def register_cache(self, cache):
        """A TieredCache over this backend: a reshard renames its entries' CPU blocks (remap_blocks), a clear
        waits for its calls in flight (wait_quiet)."""
        self._resharder.register_cache(cache)

    def _take_geometry(self, spec: CacheSpec, tp: int, device_ids: list):
        """A reshard's commit: the deployment's new spec, tp and devices (engine/reshard_host.py)."""
        self.spec, self.tp_size, self.device_ids = spec, tp, device_ids

    # -- weights (docs/design.md §11; engine/weights.py) ---------------------------------------------------
    @property
    def weight_layout(self) -> WeightSpec | None:
        """The placed WeightSpec (given to each worker's register_weights), None without weights."""
        return self._weights.layout

    def weight_region(self, rank: int) -> np.ndarray:
        """Rank's CPU weight region as uint8 [num_layers, layer_bytes]: CPU block l holds layer l (for checks
        and tools)."""
        return self._weights.region(rank)

    def stream_weights(self) -> TransferHandle:
        """Stream the offloaded layers of one forward pass into the ring of device slots, in order; a slot is
        refilled once the forward has moved past the layer it held. `handle.wait_layer(i)` returns once the
        i-th offloaded layer is in place; a worker's forward waits by `handle.task_id`."""
        return self._weights.stream()

    def sleep(self, level: int = 1, timeout: float = 60.0):
        """Free every rank's KV cache and weights, as clear_caches frees the cache (status CLEARED). level 1
        first copies the resident weights into the CPU weight region and compares them there; level 2 copies
        nothing (new weights come after wake). A dead rank fails it naming the rank: restart_rank, sleep again."""
        self._phases.sleep(level, timeout)

    def wake(self, timeout: float = 60.0):
        """Re-create every rank's weights and KV cache (status NORMAL); after sleep(1) the weights are copied
        back first. A dead rank fails it naming the rank: restart_rank, wake again."""
        self._phases.wake(timeout)

    @property
    def asleep(self) -> int:
        """The level of the sleep under way or done, 0 when awake."""
        return int(self.signals.sleep_level[0])

    # -- clear / restore (docs/design.md §6; engine/phases.py) ----------------------------------------------
    def clear_caches(self, timeout: float = 60.0):
        """Release every rank's cache memory; returns once all of it is free (status CLEARED)."""
        self._phases.clear(timeout)

    def restore_caches(self, timeout: float = 60.0):
        """Re-create every rank's cache; returns once all ranks are ready again (status NORMAL)."""
        self._phases.restore(timeout)

    def also_reap(self, suffix: str):
        """Segments of another suffix that this process creates (an integration's own): if the process is
        killed, the reaper removes them with the deployment's (a no-op with FASTCACHE_REAPER=0)."""
        if self._reaper is not None:
            self._reaper.watch(suffix)

    # -- shutdown --------------------------------------------------------------------------------
    def close(self, timeout: float = CLOSE_TIMEOUT):
        """Stop the transfer managers and remove every segment and socket this deployment created, within
        about `timeout` seconds: the caches' puts in flight get what is left of it less STOP_GRACE (a hung
        store's puts are then reported as not landed), and a transfer manager not gone by the end is killed."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 86400:
            raise ValueError(f"close timeout must be a number of seconds in [0, 86400], got {timeout!r}")
        if self._closed or not self._started:
            self._closed = True
            return
        deadline = time.monotonic() + timeout
        self._resharder.close_caches(max(0.0, timeout - STOP_GRACE))
        self._closed = True
        self._ranks.begin_close()
        told = {}       # rank -> the stop's number on its pipe
        if self._channel.serving:
            self._channel.send_all(protocol.encode("stop"), sent=told)
        self._ranks.stop(grace=max(0.5, deadline - time.monotonic()), told=told)
        # only now: a transfer manager may still map the workers' memory (CUDA IPC) until it has exited. A
        # backend refused at start (the suffix belongs to a live deployment) created nothing: the workers
        # in this process are the running deployment's, not its own
        if self.signals is not None:
            close_local_workers(self.suffix)
        self._channel.close("the backend was closed")
        self._tiers.release()
        self._weights.release_regions()
        self._resharder.close()
        if self.barrier is not None:
            self.barrier.close()
        self._ready_view = None         # its views of the signals go before they are unmapped
        if self.signals is not None:
            self.signals.close()
        if hasattr(self, "socket_dir"):
            remove_socket_dir(self.socket_dir)
        remove_dead(suffix=self.suffix)      # what killed workers of this deployment could not unlink
        self._store_tasks.close()
        if self._reaper is not None:
            self._reaper.close()

