"""fastcache as vLLM's KV offloading backend: the OffloadingSpec vLLM's OffloadingConnector loads, and
FastcacheConnector, the same connector with failed transfers recomputed instead of asserted away.

    kv_transfer_config = {"kv_connector": "FastcacheConnector",
                          "kv_connector_module_path": "fastcache.integrations.vllm",
                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": {"spec_name": "FastcacheOffloadingSpec",
                                                        "spec_module_path": "fastcache.integrations.vllm",
                                                        "cpu_bytes_to_use": 4 << 30}}

vLLM 0.32's OffloadingConnectorWorker asserts that every transfer succeeded, so with the plain
OffloadingConnector a failed transfer stops the engine; FastcacheConnector reports a failed load's GPU blocks
through get_block_ids_with_load_errors (vLLM then recomputes them) and a failed store to the manager (it is
dropped), which is what the fault tests run.
"""
from __future__ import annotations

import logging
import os
import time
import uuid

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import OffloadingSpec

from .jobs import engine_scope
from .lineage import LineageError, checkpoint_digest, default_namespace, process_start_ns
from .link import ManagerLinks
from .manager import METRICS, FastcacheManager
from .options import VllmOptions
from .worker import FastcacheWorker

log = logging.getLogger("fastcache.vllm")


class FastcacheOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config):
        """The metrics FastcacheManager.get_stats reports, for vLLM's Prometheus registry."""
        return dict(METRICS)

    def __init__(self, config):
        super().__init__(config)
        self.options = VllmOptions.from_extra_config(dict(self.extra_config))
        parallel = config.parallel
        self.rank, self.world_size = parallel.rank, parallel.world_size
        if config.worker_kv_bytes_per_block <= 0 or self.world_size <= 0:
            raise ValueError("fastcache: vLLM gave no KV cache geometry (worker_kv_bytes_per_block is 0)")
        per_chunk = config.worker_kv_bytes_per_block * self.world_size * self.blocks_per_chunk
        self.num_chunks = self.options.cpu_bytes_to_use // per_chunk
        if self.num_chunks < 1:
            raise ValueError(f"kv_connector_extra_config: 'cpu_bytes_to_use' ({self.options.cpu_bytes_to_use}) "
                             f"holds no chunk of {per_chunk} bytes")
        self.namespace = self.options.namespace     # None: the weights' fingerprint, taken by the worker
        self._manager = self._worker = None

    def get_manager(self) -> FastcacheManager:
        if self._manager is None:
            links = ManagerLinks(self.config.engine_id, self.world_size)
            self._manager = FastcacheManager(self.num_chunks, self.blocks_per_chunk, links, self.world_size,
                                             store=self.options.store, policy=self.options.policy,
                                             store_timeout=self.options.store_timeout,
                                             enable_events=self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches) -> FastcacheWorker:
        if self._worker is None:
            if self.namespace is None:
                self.namespace = weights_namespace(self.config.model.name, self.config.model.dtype)
            self._worker = FastcacheWorker(kv_caches, engine_id=self.config.engine_id, rank=self.rank,
                                           world_size=self.world_size, num_chunks=self.num_chunks,
                                           blocks_per_chunk=self.blocks_per_chunk, options=self.options,
                                           namespace=self.namespace,
                                           reset_scope=None if self.options.namespace else
                                           engine_scope(self.config.engine_id))
        return self._worker


def _local_checkpoint(model: str, revision, download_dir) -> str:
    """The local directory vLLM loaded `model` from: the path itself, or the snapshot of a
    Hugging Face id at its revision in the local cache (vLLM downloaded it there before loading)."""
    if os.path.exists(model):
        return model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception as exc:
        raise LineageError(f"{model!r} (revision {revision!r}) is neither a local path nor in the local Hugging "
                           f"Face cache: {type(exc).__name__}: {exc}") from None


def weights_namespace(name: str, kv_dtype: str) -> str:
    """The default L3 namespace: the architecture's name, then a digest of the weights' content (checkpoint_digest)
    with the config as loaded, the dtypes and the quantization, so engines share only over the same weights.

    Where the weights cannot be named by content (dummy or other non-file load formats, a model not on
    this machine, a weight file changed since this process started, so after or while vLLM loaded it), a
    namespace of this engine alone: nothing is shared, nothing stale is served.

    LoRA adapters are loaded per request, after this: vLLM's block hash carries each LoRA request's adapter
    name and path, which keeps KV of other adapters (and of the base model) under other keys."""
    from vllm.config import get_current_vllm_config_or_none
    vllm_config = get_current_vllm_config_or_none()
    model_config = vllm_config.model_config if vllm_config is not None else None
    load_format = str(vllm_config.load_config.load_format) if vllm_config is not None else "auto"
    try:
        path = model_config.model if model_config is not None else name
        revision = model_config.revision if model_config is not None else None
        download_dir = vllm_config.load_config.download_dir if vllm_config is not None else None
        started = time.monotonic()
        # The worker loaded the weights in this process: a file changed since it started may not be what it read.
        digest = checkpoint_digest(_local_checkpoint(path, revision, download_dir), load_format,
                                   not_changed_since=process_start_ns())
        elapsed = time.monotonic() - started
        label, parts = _namespace_parts(model_config, kv_dtype, load_format)
        namespace = default_namespace(label, digest, parts)
    except LineageError as exc:
        namespace = f"{str(name)[-120:]}/engine-{uuid.uuid4().hex}"
        log.warning("fastcache: the weights cannot be named by their content (%s); L3 objects are this "
                    "engine's alone (namespace %s). Set kv_connector_extra_config 'namespace' to share them, "
                    "and change it whenever the weights change.", exc, namespace)
        return namespace
    log.info("fastcache: namespace %s (weights' content hashed in %.2f s)", namespace, elapsed)
    return namespace


def _namespace_parts(model_config, kv_dtype: str, load_format: str) -> tuple[str, dict]:
    """The architecture's name, and everything besides the weights' bytes that shapes the KV bytes: the
    model config as loaded, the dtypes, the quantization and the load format."""
    parts, label = {"kv_dtype": kv_dtype, "load_format": load_format}, "model"
    if model_config is not None:
        hf = {k: v for k, v in model_config.hf_config.to_dict().items()
              if not k.startswith("_") and k != "transformers_version"}
        parts.update(dtype=str(model_config.dtype), quantization=model_config.quantization, hf_config=hf)
        label = (hf.get("architectures") or [hf.get("model_type") or "model"])[0]
    return label, parts


class _RecomputingWorker(OffloadingConnectorWorker):
    """vLLM's connector worker, except that a failed transfer is counted done and, for a load, its GPU blocks
    are reported as load errors (vLLM 0.32 asserts success instead)."""

    def get_finished(self, finished_req_ids):
        finished_recving = set()
        meta = self._connector_worker_meta
        for result in self.worker.get_finished():
            is_load = result.job_id in self._load_jobs
            if result.success and result.transfer_time is not None and result.transfer_size is not None:
                stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                stats.record(result.transfer_size, result.transfer_time)
            meta.mark_completed(result.job_id)
            req_id = self._load_jobs.pop(result.job_id, None)
            if req_id is not None:
                finished_recving.add(req_id)
        return set(), finished_recving

    def load_errors(self) -> set[int]:
        take = getattr(self.worker, "take_load_errors", None)
        return take() if take is not None else set()


class FastcacheConnector(OffloadingConnector):
    """OffloadingConnector whose failed loads are recomputed (set kv_load_failure_policy="recompute")."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            old = self.connector_worker
            self.connector_worker = _RecomputingWorker(old.spec, old.vllm_config, old.kv_cache_config)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None or self.connector_worker.worker is None:
            return set()
        return self.connector_worker.load_errors()
