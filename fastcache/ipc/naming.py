"""Names of a deployment's shared objects. Every name carries the deployment's suffix."""
import os
import secrets

PREFIX = "fastcache"


def new_suffix() -> str:
    """The engine's pid plus a random token: two deployments on one machine never collide."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def segment_name(suffix: str, what: str) -> str:
    """POSIX shared-memory name; it appears in /dev/shm without the leading slash."""
    return f"/{PREFIX}.{suffix}.{what}"


def signal_name(suffix: str, signal: str) -> str:
    return segment_name(suffix, f"signal.{signal}")


def swap_space_name(suffix: str, rank: int) -> str:
    return segment_name(suffix, f"swap_rank{rank}")


def cache_arena_name(suffix: str, rank: int, generation: int) -> str:
    """The sim device's cache memory of one rank; the generation changes on every restore."""
    return segment_name(suffix, f"cache_rank{rank}.gen{generation}")


def manifest_name(suffix: str, rank: int) -> str:
    return segment_name(suffix, f"exports_rank{rank}")


def barrier_name(suffix: str) -> str:
    return segment_name(suffix, "barrier")


def reshard_plan_name(suffix: str) -> str:
    """The current reshard step's JSON (docs/design.md §9), written by the engine, read by the workers."""
    return segment_name(suffix, "reshard")


def reshard_staging_name(suffix: str, rank: int, kind: str) -> str:
    """A rank's reshard staging buffer in shared memory: "gpu" (the sim device's, its worker's) or "cpu" (the
    CPU tier's, the engine's)."""
    return segment_name(suffix, f"reshard_{kind}_staging_rank{rank}")


def reshard_exports_name(suffix: str, rank: int) -> str:
    """How a worker exports its GPU staging buffer (JSON) for the reshard step."""
    return segment_name(suffix, f"reshard_exports_rank{rank}")


def device_memory_name(suffix: str, rank: int) -> str:
    """A worker's report of its device memory after a reshard's commit (JSON; docs/design.md §9)."""
    return segment_name(suffix, f"device_memory_rank{rank}")


def weights_name(suffix: str, rank: int, what: str) -> str:
    """A rank's weight group (docs/design.md §11): "cpu" (the engine's CPU region), "exports" (its worker's
    manifest) or "gen<N>" (the sim device's weight memory)."""
    return segment_name(suffix, f"weights_{what}_rank{rank}")


def events_name(suffix: str, rank: int, what: str, generation: int) -> str:
    """Interprocess CUDA event handles a rank's process exports (JSON): "layers" and "weights" (its transfer
    manager's, per task slot and layer), "ring_free" (its worker's, per ring slot), "fence" (its worker's, per fence
    slot). The generation, announced
    in the ipc_events signal, is new for every creator, so a restarted one never meets a dead one's leftover."""
    return segment_name(suffix, f"events_{what}_rank{rank}.g{generation:x}")
