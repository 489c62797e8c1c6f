"""Runs vLLM's real engine (CPU build) over a tiny random Llama checkpoint (fastcache/tools/tiny_llama.py, read by vLLM's
own loader; --hybrid: a tiny Gemma 2, fastcache/tools/tiny_gemma2.py) with and without fastcache and prints
what tests/test_vllm.py checks, as one JSON line. A separate process per run: vLLM spawns its own processes
and wants the `__main__` guard.

    python tests/vllm_driver.py --rounds 2 [--fastcache] [--model DIR] [--seed N] [--store URL] ...

The batch: 64 prompts that share prefixes of 1-4 blocks among 4 bases, each with a tail of its own, then 16
probes: every base's 1-4 block prefix before one common tail. Probes of one prefix length differ only in
their prefix, so their outputs tell the KV of one prefix from another's.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")       # vLLM's block hashes: equal across engines (L3 sharing)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fastcache.tools import tiny_gemma2, tiny_llama  # noqa: E402


class Inspect:
    """Mixed into vLLM's workers (worker_extension_cls), called by name through collective_rpc: reads what
    fastcache's worker chose, changes nothing."""

    def fastcache_namespace(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        if not has_kv_transfer_group():
            return None
        return get_kv_transfer_group().connector_worker.spec.namespace

    def fastcache_groups(self):
        """The layers of each KV cache group fastcache's worker serves, and the KV tensors each one uses."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        if not has_kv_transfer_group():
            return None
        connector = get_kv_transfer_group().connector_worker
        return {"layers": [list(group.layer_names) for group in connector.kv_cache_config.kv_cache_groups],
                "tensors": getattr(connector.worker, "group_tensors", None)}

    def cpu_shm(self):
        """Whether vLLM's CPU communicator of the tensor-parallel group runs over shared memory (its C++ SHM
        manager: not in every vllm-cpu build for every CPU; else torch.distributed, with no /dev/shm segment)."""
        from vllm.distributed import parallel_state
        communicator = getattr(parallel_state.get_tp_group(), "device_communicator", None)
        return type(getattr(communicator, "dist_module", None)).__name__ == "_CPUSHMDistributed"

    def dist_ident(self):
        """vLLM's name for this engine's CPU shared-memory groups (tp > 1), which its workers unlink at a clean
        exit only: a run whose workers were cut short (a shutdown timed out on a busy machine) left them"""
        return os.environ.get("VLLM_DIST_IDENT")


def remove_dist_segments(idents) -> list[str]:
    """Remove the /dev/shm segments vLLM's CPU communicator made for this run's engine (named with its ident);
    returns their names."""
    removed = []
    for name in os.listdir("/dev/shm"):
        if name.startswith("vllm_dist_") and any(ident in name for ident in idents):
            try:
                os.unlink(os.path.join("/dev/shm", name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def fastcache_metrics() -> dict:
    """The connector's own metrics (FastcacheOffloadingSpec's), from this process's Prometheus registry, where vLLM
    registered them; LLM.get_metrics() lists only vllm:* names."""
    from prometheus_client import REGISTRY
    return {metric.name: sum(s.value for s in metric.samples if s.name in (metric.name, metric.name + "_total"))
            for metric in REGISTRY.collect() if metric.name.startswith("fastcache:")}


def transfer_managers():
    import psutil
    return [p for p in psutil.Process().children(recursive=True)
            if "fastcache.transfer" in " ".join(p.cmdline())]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fastcache", action="store_true")
    ap.add_argument("--cpu-bytes", type=int, default=256 << 20)
    ap.add_argument("--store")
    ap.add_argument("--namespace")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config, JSON")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", help="a checkpoint directory or Hugging Face id (default: --seed's, written here)")
    ap.add_argument("--revision")
    ap.add_argument("--load-format", default="auto", help="vLLM's load_format (dummy: no checkpoint read)")
    ap.add_argument("--seed", type=int, default=1, help="weights' seed when no --model is given")
    ap.add_argument("--hybrid", action="store_true",
                    help="the tiny Gemma 2 (sliding-window and global layers) and its prompts, not the tiny Llama")
    ap.add_argument("--update-seed", type=int,
                    help="after round 1: the engine reloads this seed's weights in place (reload_weights)")
    ap.add_argument("--reset", choices=("connector", "plain"), default="connector",
                    help="after an update: reset_prefix_cache(reset_connector=True), or the plain call")
    ap.add_argument("--kill-after", type=int, help="kill the transfer managers after this round")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--kv-events", action="store_true",
                    help="enable vLLM's KV events (a zmq publisher in the scratch directory) and report them")
    ap.add_argument("--longest-first", action="store_true",
                    help="submit the batch longest prompt first (outputs are reported in prompts() order)")
    args = ap.parse_args()

    here = os.path.dirname(os.path.abspath(__file__))      # vLLM's workers import Inspect from here
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    if args.tp > 1:     # vllm-cpu binds each rank's threads; on one NUMA node it must be told where
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(r % (os.cpu_count() or 1)) for r in range(args.tp)))
    scratch = tempfile.mkdtemp(prefix="fastcache-llama-")
    try:
        run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class KvEvents:
    """vLLM's KV events as a subscriber gets them: a SUB socket on the engine's publisher, read by a thread."""

    def __init__(self, endpoint):
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch
        self.endpoint, self.batches, self._stop = endpoint, [], False
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)         # before the engine binds it: zmq connects once it is there
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self._seen = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while not self._stop:
            if self._sub.poll(50):
                _, _, payload = self._sub.recv_multipart()
                with self._seen:
                    self.batches.append(self._decode(payload))
                    self._seen.notify_all()

    def wait_past(self, stamp, timeout=60.0):
        """Until a batch made after `stamp` (time.time()) arrived: every batch published before it has too."""
        with self._seen:
            if not self._seen.wait_for(lambda: any(b.ts > stamp for b in self.batches), timeout):
                raise TimeoutError(f"no KV event batch after {stamp} in {timeout} s")

    def report(self, before):
        """Per medium, [event type, block hash] in order (a clear's hash None), of the batches made before
        `before`."""
        out = {}
        for batch in (b for b in self.batches if b.ts <= before):
            for event in batch.events:
                kind = type(event).__name__
                seen = out.setdefault(getattr(event, "medium", None) or "GPU", [])
                if kind == "AllBlocksCleared":
                    seen.append([kind, None])
                else:
                    seen += [[kind, h.hex() if isinstance(h, bytes) else h] for h in event.block_hashes]
        return out

    def close(self):
        self._stop = True
        self._thread.join()
        self._sub.close(0)
        self._context.term()


def run(args, scratch):
    from vllm.config import KVTransferConfig

    tiny = tiny_gemma2 if args.hybrid else tiny_llama
    model = args.model or tiny.write_checkpoint(os.path.join(scratch, f"seed{args.seed}"), args.seed)
    kv = None
    if args.fastcache:
        extra = {"spec_name": "FastcacheOffloadingSpec", "spec_module_path": "fastcache.integrations.vllm",
                 "cpu_bytes_to_use": args.cpu_bytes, **json.loads(args.extra)}
        if args.store:
            extra["store"] = args.store
        if args.namespace:
            extra["namespace"] = args.namespace
        kv = KVTransferConfig(kv_connector="FastcacheConnector", kv_connector_module_path="fastcache.integrations.vllm",
                              kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    report = {"rounds": [], "logprobs": [], "cached": [], "external_hits": [], "load_bytes": [], "killed": [],
              "transfer_managers": 0}
    events = KvEvents(f"ipc://{scratch}/kv-events") if args.kv_events else None
    try:
        run_engine(args, scratch, tiny, model, kv, report, events)
    finally:
        if events is not None:
            events.close()


def run_engine(args, scratch, tiny, model, kv, report, events):
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    prompts, write_checkpoint = tiny.prompts, tiny.write_checkpoint
    kv_events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events.endpoint) \
        if events is not None else None
    try:
        llm = LLM(model=model, revision=args.revision, load_format=args.load_format, skip_tokenizer_init=True, enforce_eager=True, seed=0,
                  dtype="float32", kv_transfer_config=kv, disable_log_stats=False, tensor_parallel_size=args.tp,
                  worker_extension_cls="vllm_driver.Inspect", kv_events_config=kv_events)
    except Exception as exc:
        report["start_error"] = f"{type(exc).__name__}: {exc}"
        print("REPORT " + json.dumps(report), flush=True)
        return
    report["dist_idents"] = sorted({i for i in llm.collective_rpc("dist_ident") if i}) if args.tp > 1 else []
    report["cpu_shm"] = all(llm.collective_rpc("cpu_shm")) if args.tp > 1 else False
    try:
        report["namespaces"] = llm.collective_rpc("fastcache_namespace")     # one per worker rank
        report["groups"] = llm.collective_rpc("fastcache_groups")[0]
        # logprobs=0: the sampled token's own logprob
        params = SamplingParams(temperature=0, max_tokens=16, detokenize=False, logprobs=0)
        order = list(range(len(prompts())))
        if args.longest_first:
            order.sort(key=lambda i: -len(prompts()[i]))
        batch = [TokensPrompt(prompt_token_ids=prompts()[i]) for i in order]
        for rnd in range(args.rounds):
            submitted = llm.generate(batch, params, use_tqdm=False)
            outs = [None] * len(order)
            for i, out in zip(order, submitted):
                outs[i] = out
            report["rounds"].append([list(o.outputs[0].token_ids) for o in outs])
            report["logprobs"].append([o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in outs])
            report["cached"].append(sum(o.num_cached_tokens or 0 for o in outs))
            metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
            report["external_hits"].append(metrics.get("vllm:external_prefix_cache_hits"))
            report["load_bytes"].append(metrics.get("vllm:kv_offload_load_bytes"))
            report["metrics"] = {**{name: value for name, value in metrics.items() if "kv_offload" in name},
                                 **fastcache_metrics()}
            if args.update_seed is not None and rnd == 0:
                # a trainer's new weights, read by vLLM's own loader into the running engine
                update = write_checkpoint(os.path.join(scratch, f"seed{args.update_seed}"), args.update_seed)
                llm.collective_rpc("reload_weights", kwargs={"weights_path": update})
                report["update_reset"] = llm.reset_prefix_cache(reset_connector=args.reset == "connector")
            else:
                llm.reset_prefix_cache()           # round two's hits can only come from fastcache
            if args.kill_after is not None and rnd + 1 == args.kill_after:
                for proc in transfer_managers():
                    proc.kill()
                    report["killed"].append(proc.pid)
        report["transfer_managers"] = len(transfer_managers())
        if events is not None:      # one more request (a full block at least), then every batch before it is in
            mark = time.time()
            block = llm.llm_engine.vllm_config.cache_config.block_size
            llm.generate([TokensPrompt(prompt_token_ids=[1] * (2 * block))], params, use_tqdm=False)
            events.wait_past(mark)
            report["kv_events"] = events.report(before=mark)
    finally:
        report["dist_removed"] = remove_dist_segments(report["dist_idents"])
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
