"""The worker side: a one-rank fastcache deployment inside each vLLM worker process, over vLLM's own KV tensors.

The worker's `SwapBackend` spawns this rank's transfer manager and owns the CPU tier; a `CacheWorker` adopts
vLLM's `(num_blocks, page_bytes)` tensors where they lie (sim: moved into shared memory in place once; cuda:
exported by CUDA IPC), so the bytes vLLM computes with are the bytes fastcache moves. A vLLM job is one swap
task (a load from L3 is a fetch into the CPU tier, then the swap-in); its handle's completion is one
TransferResult, a failed handle `success=False` with the job's GPU blocks reported as load errors.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
import time

import numpy as np
from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult

from ...config import CacheSpec, Settings
from ...engine.backend import SwapBackend
from ...errors import TransferError
from ...worker.cache_worker import CacheWorker
from .keys import chunk_blocks, gpu_to_cpu_blocks
from .link import WorkerLink, link_suffix
from .jobs import rank_namespace

log = logging.getLogger("fastcache.vllm")

# Tests only: every load reads the chunk after the one it was given, so the engine computes with another
# block's KV (or none): the negative control that shows an engine test can see wrong KV.
TEST_WRONG_CHUNK = "FASTCACHE_TEST_VLLM_WRONG_CHUNK"


def cache_spec(kv_caches, num_cpu_blocks: int) -> CacheSpec:
    """vLLM's canonical tensors as a fastcache geometry: one 'layer' per tensor, one row of page bytes per
    block (block_size 1, one head, head_dim = page bytes, uint8).

    Several KV cache groups (hybrid models: sliding-window and global layers) share these tensors: tensor t
    holds layer t of each group that has one, and vLLM's block pool gives a block to one group at a time, so
    block b of any group is row b of every tensor, and a job moves its blocks' rows of every tensor
    (docs/design.md §10). A group with fewer layers than tensors (vLLM pads the last group of a kind) also
    moves its blocks' rows of the tensors it does not use: rows no layer reads while the block is that
    group's."""
    groups = kv_caches.group_data_refs
    if not groups or not all(groups):
        raise ValueError(f"vLLM gave KV cache groups without layers: {[len(g) for g in groups]} references")
    shapes = {tuple(t.tensor.shape) for t in kv_caches.tensors}
    if len(shapes) != 1:
        raise ValueError(f"fastcache needs one page size for every KV tensor, got shapes {sorted(shapes)}")
    num_blocks, page = shapes.pop()
    for t in kv_caches.tensors:
        if t.tensor.stride() != (page, 1) or t.page_size_bytes != page:
            raise ValueError(f"KV tensor of stride {t.tensor.stride()} and page {t.page_size_bytes}: fastcache "
                             f"needs contiguous pages (packed layouts are not supported)")
    for g, refs in enumerate(groups):
        used = [r.tensor_idx for r in refs]
        if len(set(used)) != len(used) or not all(0 <= i < len(kv_caches.tensors) for i in used):
            raise ValueError(f"KV cache group {g} references tensors {used} of {len(kv_caches.tensors)}: "
                             f"fastcache needs each group's layers in tensors of their own")
        if any(r.page_size_bytes > page for r in refs):
            raise ValueError(f"KV cache group {g} has pages of {[r.page_size_bytes for r in refs]} bytes in "
                             f"tensors of {page}-byte pages")
    return CacheSpec(num_layers=len(kv_caches.tensors), num_gpu_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks,
                     block_size=1, num_kv_heads=1, head_dim=page, cache_dtype="uint8", has_value=False)


@dataclasses.dataclass
class Job:
    job_id: int
    load: bool
    gpu: list | np.ndarray       # gpu_to_cpu_blocks' pairs: lists for a small transfer
    cpu: list | np.ndarray
    spec: object                 # the manager's FastcacheStoreSpec / FastcacheLoadSpec
    handle: object = None        # the current task's TransferHandle (a fetch's, then the swap's)
    fence: object = None         # cuda: the swap waits for vLLM's stream as it was at submit (docs/design.md §10)
    fetching: bool = False
    started: float = dataclasses.field(default_factory=time.monotonic)
    error: str | None = None
    unplaced: list = dataclasses.field(default_factory=list)    # a load's GPU blocks of NO_CHUNK keys: failed
    overdue: bool = False        # a swap-in past transfer_timeout (warned once; still reported only when it ends)


class FastcacheWorker(OffloadingWorker):
    def __init__(self, kv_caches, *, engine_id: str, rank: int, world_size: int, num_chunks: int,
                 blocks_per_chunk: int, options, namespace: str, reset_scope: str | None = None):
        self.rank, self.world_size, self.bpc = rank, world_size, blocks_per_chunk
        self.options, self.namespace, self.reset_scope = options, namespace, reset_scope
        spec = cache_spec(kv_caches, num_chunks * blocks_per_chunk)
        tensors = [t.tensor for t in kv_caches.tensors]
        self.group_tensors = [[r.tensor_idx for r in refs] for refs in kv_caches.group_data_refs]
        device = "cuda" if tensors[0].is_cuda else "sim"
        device_id = tensors[0].device.index or 0 if device == "cuda" else 0
        self.device, self.device_id = device, device_id
        settings = dataclasses.replace(Settings.from_env(), transfer_timeout=options.transfer_timeout)
        self.backend = SwapBackend(spec, tp_size=1, device=device, store=options.store, device_ids=[device_id],
                                   settings=settings)
        self.cache_worker = self.link = None
        self._jobs: dict[int, Job] = {}
        self._done: list[TransferResult] = []
        self._puts: list = []                   # L3 write-through handles, reaped as they finish
        self._load_errors: set[int] = set()
        self._restarting: threading.Thread | None = None
        self._wrong_chunk = os.environ.get(TEST_WRONG_CHUNK) == "1"
        if self._wrong_chunk:
            log.warning("fastcache: %s=1: every load reads the wrong chunk (a test fault)", TEST_WRONG_CHUNK)
        try:
            self.backend.start()
            names = [info.name for info in spec.tensors(0, device_id)]
            self.cache_worker = CacheWorker(spec, 0, 1, device=device, suffix=self.backend.suffix, framework="torch",
                                            device_id=device_id, settings=settings,
                                            tensors=dict(zip(names, tensors))).start()
            self.backend.wait_ready(timeout=60)
            self.backend.also_reap(link_suffix(engine_id))     # vLLM's server SIGKILLs its workers at stop
            self.link = WorkerLink(engine_id, rank, spec, num_chunks, namespace, reset_scope)
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)          # vLLM may exit without calling shutdown(): leave nothing behind
        log.info("fastcache: rank %d of %d, %s, %d CPU chunks of %d bytes, %s, KV cache groups over tensors %s",
                 rank, world_size, device, num_chunks, spec.cpu_block_bytes * blocks_per_chunk,
                 options.store or "no L3", self.group_tensors)

    # -- vLLM's interface ------------------------------------------------------------------------
    def submit_store(self, job_id, src_spec, dst_spec) -> bool:
        gpu, cpu = gpu_to_cpu_blocks(src_spec.block_ids, src_spec.group_sizes, src_spec.block_indices,
                                     dst_spec.block_ids, self.bpc)
        job = self._jobs[job_id] = Job(job_id, False, gpu, cpu, dst_spec)
        self._start(job, lambda: self.backend.swap_out(gpu, cpu, fence=self._fence()))
        return True

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:
        gpu, cpu = gpu_to_cpu_blocks(dst_spec.block_ids, dst_spec.group_sizes, dst_spec.block_indices,
                                     src_spec.block_ids, self.bpc)
        unplaced = []
        if len(cpu) and (min(cpu) if type(cpu) is list else cpu.min()) < 0:
            # the manager's NO_CHUNK: L3 hits no CPU chunk could take; their blocks fail, the rest load
            keep = np.asarray(cpu) >= 0
            unplaced = np.asarray(gpu)[~keep].tolist()
            gpu, cpu = np.asarray(gpu)[keep], np.asarray(cpu)[keep]
        if self._wrong_chunk:
            cpu = (np.asarray(cpu) + self.bpc) % self.backend.spec.num_cpu_blocks
        job = self._jobs[job_id] = Job(job_id, True, gpu, cpu, src_spec, unplaced=unplaced)
        if unplaced and not len(gpu):
            job.error = "no CPU chunk was free for its L3 fetch"
            return True
        try:
            job.fence = self._fence()       # now, even if an L3 fetch comes first: what vLLM queued so far
        except TransferError as exc:
            job.error = str(exc)
            return True
        fetch = src_spec.fetch & (src_spec.block_ids >= 0) if src_spec.fetch.any() else None
        if fetch is not None and fetch.any():
            job.fetching = True
            fetched = chunk_blocks(src_spec.block_ids[fetch], self.bpc)
            hashes = src_spec.hashes.reshape(-1, self.bpc)[fetch[src_spec.fetch]].reshape(-1)
            self._start(job, lambda: self.backend.store_to_cpu(self._l3_namespace(src_spec), hashes, fetched))
        else:
            self._start(job, lambda: self.backend.swap_in(gpu, cpu, fence=job.fence))
        return True

    def get_finished(self) -> list[TransferResult]:
        for job in list(self._jobs.values()):
            self._advance(job)
        self._reap_puts()
        done, self._done = self._done, []
        return done

    def wait(self, job_ids):
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            while job is not None and job_id in self._jobs:
                if job.handle is not None and job.error is None:
                    try:
                        job.handle.result(timeout=self.options.transfer_timeout)
                    except TransferError as exc:
                        job.error = str(exc)
                    except TimeoutError as exc:
                        if not self._writes_gpu(job):   # a swap-in is waited for to its end (_advance)
                            job.error = str(exc)
                self._advance(job)

    def take_load_errors(self) -> set[int]:
        """GPU blocks whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        atexit.unregister(self.shutdown)
        for closer in (self.cache_worker, self.backend, self.link):
            if closer is not None:
                try:
                    closer.close()
                except Exception as exc:        # shutting down: say it, go on closing the rest
                    log.warning("fastcache: closing %s: %s", type(closer).__name__, exc)
        self.cache_worker = self.link = None

    # -- jobs ------------------------------------------------------------------------------------
    def _fence(self):
        """What a job's copy waits for: vLLM's current stream as it is now. A store then reads only after the
        forward that wrote its blocks (async scheduling submits it while that forward may still run), a load
        writes only after pending writes to its destination blocks, their zeroing included (as vLLM's own CPU
        offloading orders its transfer streams). No host wait; None on CPU, where the forward is over."""
        if self.device != "cuda":
            return None
        import torch
        return self.cache_worker.fence(torch.cuda.current_stream(self.device_id))

    def _start(self, job, submit):
        try:
            job.handle = submit()
        except (TransferError, ValueError) as exc:
            job.error = str(exc)

    def _advance(self, job):
        """Move a job on if its task finished: a fetch to its swap-in, a swap to its result."""
        if job.error is None and not job.handle.done():
            if time.monotonic() - job.started < self.options.transfer_timeout:
                return
            if self._writes_gpu(job):
                # Reported, failed or not, its blocks go back to vLLM (recomputed, or freed with their request)
                # while the copy may still land in them: it is reported once it ended (a transfer manager that
                # dies or stops answering ends its tasks: docs/design.md §10).
                if not job.overdue:
                    job.overdue = True
                    log.warning("fastcache: load job %d has no result after %g s; waiting for its swap-in",
                                job.job_id, self.options.transfer_timeout)
                return
            job.error = f"no result after {self.options.transfer_timeout} s"
        if job.error is None and job.handle.error is not None:
            job.error = job.handle.error
        if job.error is None and job.fetching:
            spec = job.spec
            fetched = spec.fetch & (spec.block_ids >= 0)
            self.link.stamp(spec.block_ids[fetched], spec.stamps[fetched])
            job.fetching = False
            self._start(job, lambda: self.backend.swap_in(job.gpu, job.cpu, fence=job.fence))
            return
        del self._jobs[job.job_id]
        if job.error is not None:
            self._failed(job)
            return
        if not job.load:
            self.link.stamp(job.spec.block_ids, job.spec.stamps)
            self._write_through(job.spec)
        elif job.unplaced:          # the rest landed; vLLM recomputes these (from the first of them on)
            self._load_errors.update(job.unplaced)
            self._done.append(TransferResult(job.job_id, False))
            return
        nbytes = self.backend.spec.task_bytes(job.gpu)
        self._done.append(TransferResult(job.job_id, True, nbytes, time.monotonic() - job.started))

    @staticmethod
    def _writes_gpu(job) -> bool:
        """Is the job's task in flight a swap-in (a load past its L3 fetch)?"""
        return job.load and not job.fetching and job.handle is not None

    def _failed(self, job):
        log.warning("fastcache: %s job %d failed: %s", "load" if job.load else "store", job.job_id, job.error)
        if job.load:
            self._load_errors.update(int(b) for b in job.gpu)
            self._load_errors.update(job.unplaced)
        self._done.append(TransferResult(job.job_id, False))
        self._recover()

    def _recover(self):
        """Restart a dead transfer manager in the background; jobs meanwhile fail at once (vLLM recomputes)."""
        if 0 not in self.backend.failed_ranks or (self._restarting and self._restarting.is_alive()):
            return

        def restart():
            try:
                self.backend.restart_rank(0, timeout=60)
                log.warning("fastcache: rank %d's transfer manager restarted", self.rank)
            except Exception as exc:
                log.error("fastcache: restarting rank %d's transfer manager failed: %s", self.rank, exc)
        self._restarting = threading.Thread(target=restart, name="fastcache-vllm-restart", daemon=True)
        self._restarting.start()

    def _write_through(self, spec):
        if self.options.store is None or not len(spec.hashes):
            return
        try:
            self._puts.append(self.backend.cpu_to_store(self._l3_namespace(spec), spec.hashes,
                                                        chunk_blocks(spec.block_ids, self.bpc)))
        except (TransferError, ValueError) as exc:
            log.warning("fastcache: L3 put not submitted: %s", exc)

    def _reap_puts(self):
        for handle in [h for h in self._puts if h.done()]:
            self._puts.remove(handle)
            if handle.error is not None:
                log.warning("fastcache: L3 put failed: %s", handle.error)

    def _l3_namespace(self, spec) -> str:
        return rank_namespace(self.namespace, spec.generation, self.rank, self.world_size, self.reset_scope)
