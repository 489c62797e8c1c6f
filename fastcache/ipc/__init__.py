"""Inter-process plumbing: shared-memory signals, the phase barrier and the task queue."""
from .barrier import BrokenBarrierError, RankBarrier
from .signal import CLEARED, CLEARING, NORMAL, UPDATING, DeploymentSignals, IPCSignal

__all__ = ["IPCSignal", "DeploymentSignals", "RankBarrier", "BrokenBarrierError",
           "NORMAL", "UPDATING", "CLEARING", "CLEARED"]
