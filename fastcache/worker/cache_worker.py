"""CacheWorker: the part of a GPU worker (the engine's model runner) that owns one rank's KV cache.

It allocates the rank's tensors with the user's framework, exports them by name, sets cache_ready[r],
beats worker_heartbeat[r], and follows kv_cache_status through clear/restore on its own thread.
"""
from __future__ import annotations

import logging
import os
import secrets
import threading

from ..config import CacheSpec, Settings
from ..ipc.barrier import phase_barrier, worker_party
from ..errors import TransferError
from ..ipc.fds import FdServer, find_socket_dir
from ..ipc.heartbeat import Heartbeat
from ..ipc.leftovers import remove_dead
from ..ipc.manifest import write_manifest
from ..ipc.naming import segment_name
from ..ipc.shm import HeldSegment, SegmentHeld
from ..ipc.signal import CLEARING, RESHARDING, UPDATING, DeploymentSignals
from ..ops import get_ops
from ..ops.frameworks import check_framework
from .fences import FenceRing
from .reshard import ReshardFollower
from .streams import LayerWaits
from .weights import WorkerWeights

log = logging.getLogger("fastcache.worker")

# Workers started in this process, by deployment: SwapBackend.close() closes the ones left running.
_LOCAL_WORKERS: dict[str, list] = {}


def close_local_workers(suffix: str):
    for worker in list(_LOCAL_WORKERS.pop(suffix, [])):
        worker.close()


def claim_rank(suffix: str, rank: int) -> HeldSegment:
    """A segment only one live worker of a deployment's rank can hold: a second worker would export over the
    first one's tensors and take its place in the phase barrier. The claim of a worker that died passes on,
    to one worker only (ipc/shm.py HeldSegment: a lock the kernel drops with its holder)."""
    try:
        return HeldSegment.take(segment_name(suffix, f"worker_rank{rank}"), suffix)
    except SegmentHeld as exc:
        raise TransferError(f"rank {rank} of deployment {suffix} has a live worker already (pid {exc.pid}); "
                            f"close it before starting another for that rank") from None


def serve_descriptors(suffix: str, rank: int, cache) -> tuple[list, FdServer | None]:
    """The manifest to publish, and the server of the cache's virtual-memory descriptors if it has any: they go
    over a socket in the deployment's private directory, and the manifest says where, from which process and
    how many, so the transfer manager can check what it receives (docs/design.md §2)."""
    exports = cache.fd_exports
    if exports is None:
        return cache.manifest, None
    path = os.path.join(find_socket_dir(suffix), f"fds_rank{rank}")
    server = FdServer(path, exports.fds, {"sizes": exports.sizes})
    served = {"socket": path, "pid": os.getpid(), "count": len(exports.fds)}
    return [{**e, "vmm": {**e["vmm"], **served}} if "vmm" in e else e for e in cache.manifest], server


class CacheWorker:
    def __init__(self, spec: CacheSpec, rank: int, tp_size: int, device: str = "sim", suffix: str = "",
                 framework: str = "numpy", device_id: int | None = None, settings: Settings | None = None,
                 tensors: dict | None = None):
        """`tensors` ({name: tensor} for every tensor of spec.tensors(rank, device_id)): an engine's own cache,
        adopted instead of allocated (no copy; see DeviceOps.adopt). A clear then only lets go of it."""
        if not suffix:
            raise ValueError("suffix is required: pass the deployment's SwapBackend.suffix")
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} out of range for tp_size {tp_size}")
        check_framework(framework)
        self.spec, self.rank, self.tp_size, self.suffix = spec, rank, tp_size, suffix
        self.framework = framework
        self.device_id = rank if device_id is None else device_id
        self.settings = settings or Settings.from_env()
        self.ops = get_ops(device)
        self._adopted = tensors
        self.generation = 0
        self.identity = 0       # while started: this worker's worker_id, new at each start (never 0)
        self._cache = None
        self._by_kind = {}      # kind -> the current tensors of that kind, layer order
        self._manifest = None
        self._fd_server = None      # serves virtual-memory exports' descriptors to the transfer manager (§2)
        self._stop = threading.Event()
        self._thread = None
        self.signals = self.barrier = None
        self._reshard = ReshardFollower(self)       # docs/design.md §9: follows reshard steps on the watch thread
        self._rank_claim = None                     # while started: this process serves the rank (claim_rank)
        self.weights = None                         # WorkerWeights once registered (docs/design.md §11)
        self.layer_waits = None                     # LayerWaits once started
        self.fences = None                          # FenceRing once started (docs/design.md §4)

    # -- the tensors -----------------------------------------------------------------------------
    def _tensors(self, kind):
        return list(self._by_kind.get(kind, ()))

    key_caches = property(lambda self: self._tensors("key_caches"))
    value_caches = property(lambda self: self._tensors("value_caches"))
    key_cache_scales = property(lambda self: self._tensors("key_cache_scales"))
    value_cache_scales = property(lambda self: self._tensors("value_cache_scales"))

    @property
    def ready(self) -> bool:
        return self._cache is not None

    # -- life cycle ------------------------------------------------------------------------------
    def start(self):
        """Allocate and export the cache, set cache_ready[r]=1, and start beating. TransferError, before anything
        is touched, if a live worker holds this rank of the deployment already."""
        self._rank_claim = claim_rank(self.suffix, self.rank)
        try:
            # a killed worker of this rank left its segments (its cache, its manifest) under the names this one
            # creates, and nobody else would unlink them while the deployment runs: the claim says it is gone, and
            # what dead processes left goes by the clean-up tool's rule (nothing of a live one is touched)
            remove_dead(suffix=self.suffix)
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self):
        self.signals = DeploymentSignals(self.suffix, self.tp_size)
        # first: from now on the rank's transfer manager runs no task over an earlier worker's tensors it may map
        self.identity = secrets.randbits(62) + 1
        self.signals.worker_id[self.rank] = self.identity
        self.barrier = phase_barrier(self.suffix, self.tp_size)
        self.barrier.register(self.party)
        self.layer_waits = LayerWaits(self.signals, self.rank, self.suffix, self.device_id, self.ops.name == "cuda",
                                      self.settings.transfer_timeout)
        self.fences = FenceRing(self.signals, self.rank, self.suffix, self.device_id, self.ops.name == "cuda")
        self._allocate()
        self._heartbeat = Heartbeat(self.signals.worker_heartbeat, self.rank, self.settings.heartbeat_interval)
        self._heartbeat.start()
        self._thread = threading.Thread(target=self._watch, name=f"fastcache-worker{self.rank}", daemon=True)
        self._thread.start()
        _LOCAL_WORKERS.setdefault(self.suffix, []).append(self)
        return self

    @property
    def party(self):
        """This worker's slot in the phase barrier."""
        return worker_party(self.barrier.capacity, self.rank)

    def _allocate(self):
        self.generation += 1
        if self._adopted is not None:
            self._cache = self.ops.adopt(self.spec, self.rank, self.device_id, self._adopted)
        else:
            self._cache = self.ops.allocate(self.spec, self.rank, self.device_id, self.framework, self.suffix,
                                            self.generation)
        self._publish()
        self.signals.cache_ready[self.rank] = 1

    def reshape(self, spec):
        """Take a reshard's geometry: the tensors re-viewed in `spec`'s shape over the same memory, and
        exported again."""
        self.ops.reshape(self._cache, spec, self.rank, self.device_id, self.framework)
        self.spec = spec
        self._publish()

    def _publish(self):
        self._by_kind = {}
        for info in self.spec.tensors(self.rank, self.device_id):
            self._by_kind.setdefault(info.kind, []).append(self._cache.tensors[info.name])
        self._export()

    def _export(self):
        """Publish the cache's manifest (again, after a reshard re-viewed the tensors)."""
        self._close_exports()
        manifest, self._fd_server = serve_descriptors(self.suffix, self.rank, self._cache)
        self._manifest = write_manifest(self.suffix, self.rank, manifest, self.identity)

    def _close_exports(self):
        if self._manifest is not None:
            self._manifest.close()
            self._manifest = None
        server, self._fd_server = self._fd_server, None
        if server is not None:
            server.close()          # the cache's VmmExports owns the descriptors and closes them on release

    def _release(self):
        self._close_exports()
        self._by_kind = {}
        if self._cache is not None:
            self._reshard.forget(self._cache)      # a reshard's references to the first tensors (cuda)
            self._cache.release()
            self._cache = None
        self.signals.cache_ready[self.rank] = 0     # only now is the memory really free

    def _watch(self):
        """Follow kv_cache_status through clear and restore (docs/design.md §6): take part once in every attempt
        at a phase (the barrier's epoch counts the engine's attempts), whatever an earlier one left."""
        done = None         # (status, epoch) this worker has already taken part in
        while not self._stop.wait(0.005):
            if self.signals.status == RESHARDING:
                self._reshard.poll()
                continue
            attempt = (self.signals.status, self.barrier.epoch)
            if attempt == done or attempt[0] not in (CLEARING, UPDATING):
                continue
            done = attempt
            try:
                if attempt[0] == CLEARING:
                    # free only once every transfer manager has dropped its mappings
                    self.barrier.wait(self.party, self.settings.phase_timeout)
                    self._release()
                    if self.weights is not None and self.signals.sleep_level[0]:     # a sleep frees weights too
                        self.weights.release()
                else:
                    if self.weights is not None and not self.weights.allocated:     # waking (§11)
                        self.weights.allocate()
                    if self._cache is None:
                        self._allocate()
                    self.barrier.wait(self.party, self.settings.phase_timeout)
            except Exception as exc:    # a failed phase leaves the cache as it is; the engine reports it
                log.error("rank %d: %s failed (%s); keeping the cache as it is", self.rank,
                          "clear" if attempt[0] == CLEARING else "restore", exc)

    def wait_layer(self, task_id: int, layer: int, timeout: float | None = None, stream=None,
                   external: bool = False):
        """Wait for `layer` of the layer-by-layer swap-in `task_id` (its handle's task_id) on this rank: what a
        forward waits for before computing that layer. stream=None: returns once the layer is in place. With
        a stream on cuda (a cudaStream_t int, or a torch / CuPy stream): returns once the transfer manager has
        queued the layer's copy, with the stream made to wait for it, so kernels queued on the stream next
        read the layer's bytes and the host never waits for the copy; external=True while the stream is being
        captured into a CUDA graph (docs/design.md §11). On sim a stream is ignored (a host wait).
        Raises ValueError at once for a layer outside the cache or a task id the engine did not submit as a
        layer-by-layer swap-in (or whose slot a later one took), TransferError naming the rank as soon as the
        task fails there (before its layers start too) or its transfer manager stops beating, TimeoutError
        after `timeout` seconds."""
        if self.signals is None:
            raise TransferError("the worker is not started")
        self.layer_waits.wait(task_id, layer, timeout, stream=stream, external=external,
                              layers=self.spec.total_layers)

    def fence(self, stream=None):
        """What the next swap of this rank's blocks must wait for: pass the result as swap_out's or swap_in's
        `fence` (docs/design.md §4). On cuda (stream: the cudaStream_t int, or a torch / CuPy stream the
        model computes on) an interprocess event recorded on `stream` now, without a host wait: a swap-out
        submitted with it reads what the work queued on the stream before this call wrote, a swap-in writes
        its blocks after that work. None where there is nothing to wait for: on sim (the model's writes are
        host writes made before the call), while `stream` is being captured into a CUDA graph (fence after
        launching it), and where the driver refuses interprocess events (the stream is then synchronized
        here, on the host: ordered, logged once)."""
        if self.signals is None:
            raise TransferError("the worker is not started")
        if self.fences.cuda and stream is None:
            raise ValueError("fence(stream): name the stream the model computes on")
        return self.fences.fence(stream)

    def register_weights(self, layout) -> "WorkerWeights":
        """Allocate and export the model's weights beside the cache (docs/design.md §11): `layout` is the
        deployment's SwapBackend.weight_layout. Load them with `weights.load(layer, {name: array})`."""
        if self.signals is None or self.weights is not None:
            raise ValueError("register_weights needs a started worker, once")
        weights = WorkerWeights(layout, self)
        weights.allocate()
        self.weights = weights
        return weights

    def close(self):
        """Stop beating, free the cache, and detach from the deployment."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._heartbeat.stop()
            self._thread = None
        if self in _LOCAL_WORKERS.get(self.suffix, ()):
            _LOCAL_WORKERS[self.suffix].remove(self)
        self._reshard.release()
        self._reshard.close_report()
        if self.signals is not None:
            self._release()
            if self.weights is not None:
                if self.weights.allocated:
                    self.weights.release()
                self.weights.close_events()
            if self.layer_waits is not None:
                self.layer_waits.close()
            if self.fences is not None:
                self.fences.close()
            self.signals.worker_heartbeat[self.rank] = 0
            if self.barrier is not None:
                self.barrier.close()
            self.signals.close()
            self.signals = None
        claim, self._rank_claim = self._rank_claim, None
        if claim is not None:           # last: the rank is free for another worker only once this one let go
            claim.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
