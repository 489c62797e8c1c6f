"""The reshard's submit gate (engine/submit_gate.py): a waiting phase returns once every holder has left, not
before, and a holder whose status check refuses lets the gate go."""
from __future__ import annotations

import threading

import pytest

from fastcache.errors import RefusedError
from fastcache.engine.submit_gate import SubmitGate


def test_a_waiter_returns_only_once_every_holder_has_left():
    gate = SubmitGate(lambda what: None)
    gate.enter("swap")
    gate.enter("swap")
    assert gate.held and not gate.wait_idle(0.0)
    waited, started = [], threading.Event()

    def wait():
        started.set()
        waited.append(gate.wait_idle(30))
    waiter = threading.Thread(target=wait)
    waiter.start()
    started.wait(10)
    gate.leave()
    assert gate.held and not waited         # one holder left: still waiting
    gate.leave()
    waiter.join(30)
    assert waited == [True] and not gate.held


def test_a_refused_submission_lets_the_gate_go():
    def refuse(what):
        raise RefusedError(f"{what} refused: kv_cache_status is RESHARDING")
    gate = SubmitGate(refuse)
    with pytest.raises(RefusedError, match="swap refused"):
        gate.enter("swap")
    assert not gate.held and gate.wait_idle(0.0)
