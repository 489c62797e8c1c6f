"""The latency floor of a task round trip to tp other processes on this machine, with no work at all, built
three ways in the same run:

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

Whatever fastcache adds on top of these (validation, the copy, bookkeeping) shows as the difference to
benchmarks/task_bench.py's or `python -m fastcache.launch`'s one-block p50.

    python benchmarks/queue_floor.py [--tp 2] [--samples 2000] [--json]
"""
import argparse
import json
import os
import secrets
import select
import tempfile
import threading
import time

import numpy as np
import posix_ipc
import zmq


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


FLOORS = {"zmq": zmq_floor, "semaphore": semaphore_floor, "eventfd": eventfd_floor, "one_cpu": one_cpu_floor}


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
