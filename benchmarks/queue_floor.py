"""The latency floor of a task round trip to tp other processes on this machine, with no work at all, built
five ways in the same run:

  zmq        SwapBackend's sockets: the submitting thread writes one PUSH per rank, each rank process reads
             its PULL and answers on a DEALER, an I/O thread reads the ROUTER and wakes the submitter through
             a threading.Event when every rank has answered.
  semaphore  a named POSIX semaphore per rank as the doorbell there, and one back, the submitter blocked on it
             (posix_ipc): one wake-up of each rank and one of the submitter.
  eventfd    an eventfd per rank as the doorbell there (the rank blocked in poll), one eventfd back read by an
             I/O thread that wakes the submitter through a threading.Event (the shape of fastcache's
             completion ring).
  one_cpu    the semaphore floor with the submitter and every rank on one CPU: each wake-up a
             switch on that CPU, with no CPU woken from idle. On a VM, the difference to `semaphore` is the
             hypervisor waking an idle vCPU (an interrupt to a halted vCPU), which the others pay per wake-up.
  rings      fastcache's own mechanism and nothing else: the submitter writes a one-block record in each
             rank's task ring (fastcache.ipc.task_ring: packed, keyed BLAKE2b, commit word) and rings its
             eventfd; the rank reads and checks it, writes a record in its completion ring
             (fastcache.ipc.done_ring) and rings the submitter's eventfd, then stays awake for 1 ms looking for
             the next record before it sleeps in poll, as a transfer manager does (FASTCACHE_SPIN_US); the
             submitter sleeps on one rank's doorbell and reads the completion rings itself, as result() does.
             Every answer is checked (the task it names). No handle, checks, metrics, I/O thread, copy or
             scheduling: what the rings cost in Python.

Whatever fastcache adds on top of these (validation, the copy, bookkeeping) shows as the difference to
benchmarks/task_bench.py's or `python -m fastcache.launch`'s one-block p50; against `rings`, that difference
is all the engine's and the transfer manager's own work around the mechanism.

    python benchmarks/queue_floor.py [--tp 2] [--samples 2000] [--json]
"""
import argparse
import json
import os
import secrets
import select
import signal
import sys
import tempfile
import threading
import time

import numpy as np
import posix_ipc
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fastcache.ipc import done_ring, task_ring  # noqa: E402
from fastcache.ipc.protocol import SWAP_TO_CPU  # noqa: E402
from fastcache.ipc.shm import SharedSegment  # noqa: E402


def zmq_rank(socket_dir, rank):
    context = zmq.Context()
    tasks = context.socket(zmq.PULL)
    tasks.connect(f"ipc://{socket_dir}/tasks{rank}")
    replies = context.socket(zmq.DEALER)
    replies.setsockopt(zmq.IDENTITY, b"rank%d" % rank)
    replies.connect(f"ipc://{socket_dir}/replies")
    while True:
        frames = tasks.recv_multipart()
        if frames[0] == b"stop":
            os._exit(0)
        replies.send_multipart(frames[:1])


def fork(fn, *args):
    pid = os.fork()
    if pid == 0:
        try:
            fn(*args)
        finally:
            os._exit(0)
    return pid


def zmq_floor(tp, samples):
    socket_dir = tempfile.mkdtemp(prefix="queue-floor.")
    context = zmq.Context()
    pushes = []
    for rank in range(tp):
        push = context.socket(zmq.PUSH)
        push.bind(f"ipc://{socket_dir}/tasks{rank}")
        pushes.append(push)
    router = context.socket(zmq.ROUTER)
    router.bind(f"ipc://{socket_dir}/replies")
    children = [fork(zmq_rank, socket_dir, rank) for rank in range(tp)]
    waiting = {}                 # task id -> [event, ranks still to answer]
    lock = threading.Lock()

    def serve():
        while True:
            frames = router.recv_multipart()
            if frames[1] == b"stop":
                return
            with lock:
                entry = waiting[int(frames[1])]
                entry[1] -= 1
                if entry[1] == 0:
                    entry[0].set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    latencies = []
    cpu = time.process_time()
    for task_id in range(samples):
        start = time.perf_counter()
        event = threading.Event()
        with lock:
            waiting[task_id] = [event, tp]
        for push in pushes:
            push.send_multipart([b"%d" % task_id, b"gpu ids", b"cpu ids"])
        event.wait(10)
        latencies.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    for push in pushes:
        push.send_multipart([b"stop"])
    for pid in children:
        os.waitpid(pid, 0)
    stopper = context.socket(zmq.DEALER)
    stopper.connect(f"ipc://{socket_dir}/replies")
    stopper.send_multipart([b"stop"])
    thread.join(10)
    for sock in pushes + [router, stopper]:
        sock.close(0)
    context.term()
    for name in os.listdir(socket_dir):
        os.unlink(os.path.join(socket_dir, name))
    os.rmdir(socket_dir)
    return latencies, cpu


def semaphore_rank(there, back, pin=None):
    if pin is not None:
        os.sched_setaffinity(0, {pin})
    there, back = posix_ipc.Semaphore(there), posix_ipc.Semaphore(back)
    while True:
        there.acquire()
        if os.path.exists(STOP_FILE[0]):
            return
        back.release()


STOP_FILE = [""]


def semaphore_floor(tp, samples, pin=None):
    """pin: the CPU every rank runs on (None: wherever the scheduler puts them)."""
    tag = secrets.token_hex(4)
    stop_dir = tempfile.mkdtemp(prefix="queue-floor.")
    STOP_FILE[0] = os.path.join(stop_dir, "stop")
    there = [posix_ipc.Semaphore(f"/queue-floor.{tag}.there{r}", posix_ipc.O_CREX, mode=0o600) for r in range(tp)]
    back = posix_ipc.Semaphore(f"/queue-floor.{tag}.back", posix_ipc.O_CREX, mode=0o600)
    children = [fork(semaphore_rank, there[r].name, back.name, pin) for r in range(tp)]
    latencies = []
    cpu = time.process_time()
    for _ in range(samples):
        start = time.perf_counter()
        for sem in there:
            sem.release()
        for _ in range(tp):
            back.acquire(10)
        latencies.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    open(STOP_FILE[0], "w").close()
    for sem in there:
        sem.release()
    for pid in children:
        os.waitpid(pid, 0)
    for sem in there + [back]:
        sem.unlink()
        sem.close()
    os.unlink(STOP_FILE[0])
    os.rmdir(stop_dir)
    return latencies, cpu


def eventfd_rank(there, back):
    poll = select.poll()
    poll.register(there, select.POLLIN)
    while True:
        poll.poll()
        if os.eventfd_read(there) > 1:
            return
        os.eventfd_write(back, 1)


def eventfd_floor(tp, samples):
    there = [os.eventfd(0) for _ in range(tp)]
    back = os.eventfd(0, os.EFD_NONBLOCK)
    children = [fork(eventfd_rank, there[r], back) for r in range(tp)]
    answered = [0]
    stop = threading.Event()
    waiting = {}
    lock = threading.Lock()

    def serve():            # the engine's I/O thread: block on the doorbell, then wake the waiter
        poll = select.poll()
        poll.register(back, select.POLLIN)
        while not stop.is_set():
            if not poll.poll(100):
                continue
            try:
                count = os.eventfd_read(back)
            except BlockingIOError:
                continue
            with lock:
                answered[0] += count
                entry = waiting.get("now")
                if entry is not None and answered[0] >= entry[1]:
                    entry[0].set()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    latencies = []
    cpu = time.process_time()
    for i in range(samples):
        start = time.perf_counter()
        event = threading.Event()
        with lock:
            waiting["now"] = (event, (i + 1) * tp)
        for fd in there:
            os.eventfd_write(fd, 1)
        event.wait(10)
        latencies.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    for fd in there:
        os.eventfd_write(fd, 2)
    for pid in children:
        os.waitpid(pid, 0)
    stop.set()
    thread.join(10)
    for fd in there + [back]:
        os.close(fd)
    return latencies, cpu


def one_cpu_floor(tp, samples):
    """semaphore_floor with every process on one of the CPUs this one may use (its affinity restored after)."""
    allowed = os.sched_getaffinity(0)
    pin = min(allowed)
    os.sched_setaffinity(0, {pin})
    try:
        return semaphore_floor(tp, samples, pin)
    finally:
        os.sched_setaffinity(0, allowed)


SPIN_S = 1e-3         # a transfer manager's FASTCACHE_SPIN_US default


def rings_rank(suffix, token, rank, there, back):
    tasks = task_ring.TaskRingReader(SharedSegment.attach(task_ring.ring_name(suffix, rank, 1), suffix), token,
                                     rank, 1)
    done = done_ring.RingWriter(SharedSegment.attach(done_ring.ring_name(suffix, rank, 1), suffix), token, rank, 1)
    poll = select.poll()
    poll.register(there, select.POLLIN)
    while True:
        if not tasks.pending():
            poll.poll()
        try:
            os.eventfd_read(there)
        except BlockingIOError:     # a record seen while spinning: its doorbell is still to clear
            pass
        records, _, _ = tasks.read((0, 0))
        for record in records:
            done.write(record.header["task_id"], 0, 0, 0.0)
            os.eventfd_write(back, 1)
        deadline = time.perf_counter() + SPIN_S     # awake a while after work, as a transfer manager is
        while time.perf_counter() < deadline and not tasks.pending():
            os.sched_yield()


def rings_floor(tp, samples):
    token, suffix = secrets.token_bytes(32), f"queue-floor-{secrets.token_hex(4)}"
    writers, readers, bells, children = [], [], [], []
    try:
        for r in range(tp):
            writers.append(task_ring.TaskRingWriter.create(suffix, token, r, 1))
            readers.append(done_ring.RingReader(SharedSegment.create(done_ring.ring_name(suffix, r, 1),
                                                                     done_ring.RING_BYTES, suffix), token, r, 1))
            bells.append(os.eventfd(0, os.EFD_NONBLOCK))
            children.append(fork(rings_rank, suffix, token, r, writers[r].bell, bells[r]))
        sleeps = []
        for bell in bells:
            sleeps.append(select.poll())
            sleeps[-1].register(bell, select.POLLIN)
        latencies = []
        cpu = time.process_time()
        for i in range(1, samples + 1):
            start = time.perf_counter()
            record = task_ring.inline(i, SWAP_TO_CPU, [i % 512], [i % 256])
            for writer in writers:
                writer.put(i, record)
            pending = set(range(tp))
            while pending:
                if not sleeps[max(pending)].poll(10_000):   # the rank expected last, as a waiter does
                    raise RuntimeError(f"rings floor: no completion of task {i} within 10 s from ranks "
                                       f"{sorted(pending)}")
                for rank in list(pending):
                    try:
                        os.eventfd_read(bells[rank])
                    except BlockingIOError:
                        pass
                    if readers[rank].unread():
                        records, bad = readers[rank].read()
                        if bad or [r[0] for r in records] != [i]:
                            raise RuntimeError(f"rings floor: rank {rank} answered task {i} with {records}, "
                                               f"bad {bad}")
                        pending.discard(rank)
            latencies.append(time.perf_counter() - start)
        return latencies, time.process_time() - cpu
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for part in writers + readers:      # the creator's close unlinks each ring
            part.close()
        for bell in bells:
            os.close(bell)


FLOORS = {"zmq": zmq_floor, "semaphore": semaphore_floor, "eventfd": eventfd_floor, "one_cpu": one_cpu_floor,
          "rings": rings_floor}


def measure(tp: int, samples: int) -> dict:
    """{way: {p50_us, p99_us, samples, engine_cpu_us}} for each way of building the floor, measured one after
    another; engine_cpu_us is the submitting process's CPU time per round trip (all its threads, zmq's
    included), the least the engine's side of a task costs built that way."""
    out = {}
    for name, floor in FLOORS.items():
        latencies, cpu = floor(tp, samples)
        steady = np.array(latencies[len(latencies) // 10:]) * 1e6
        out[name] = {"p50_us": float(np.percentile(steady, 50)), "p99_us": float(np.percentile(steady, 99)),
                     "samples": len(steady), "engine_cpu_us": cpu / samples * 1e6}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = measure(args.tp, args.samples)
    if args.json:
        print(json.dumps({"tp": args.tp, **figures}))
        return
    for name, fig in figures.items():
        print(f"tp={args.tp} {name:9s}: empty task round trip p50 {fig['p50_us']:7.1f} µs, "
              f"p99 {fig['p99_us']:7.1f} µs over {fig['samples']} samples, engine CPU {fig['engine_cpu_us']:5.1f} µs "
              f"per round trip")


if __name__ == "__main__":
    main()
