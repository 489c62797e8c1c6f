"""The latency floor of fastcache's task-queue topology on this machine, with no work at all.

The same sockets as SwapBackend and its transfer managers: the submitting thread writes one PUSH per rank,
each rank process reads its PULL and answers on a DEALER, an I/O thread reads the ROUTER and wakes the
submitter through a threading.Event when every rank has answered. Whatever fastcache adds on top of
this (validation, the copy, bookkeeping) shows as the difference to `python -m fastcache.launch`'s
one-block p50.

    python benchmarks/queue_floor.py [--tp 2] [--samples 2000]
"""
import argparse
import os
import tempfile
import threading
import time

import numpy as np
import zmq


def rank_process(socket_dir, rank):
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2000)
    args = parser.parse_args()
    socket_dir = tempfile.mkdtemp(prefix="queue-floor.")
    context = zmq.Context()
    pushes = []
    for rank in range(args.tp):
        push = context.socket(zmq.PUSH)
        push.bind(f"ipc://{socket_dir}/tasks{rank}")
        pushes.append(push)
    router = context.socket(zmq.ROUTER)
    router.bind(f"ipc://{socket_dir}/replies")
    children = []
    for rank in range(args.tp):
        pid = os.fork()
        if pid == 0:
            rank_process(socket_dir, rank)
        children.append(pid)

    waiting = {}                 # task id -> [event, ranks still to answer]
    lock = threading.Lock()

    def serve():
        while True:
            frames = router.recv_multipart()
            with lock:
                entry = waiting[int(frames[1])]
                entry[1] -= 1
                if entry[1] == 0:
                    entry[0].set()

    threading.Thread(target=serve, daemon=True).start()
    latencies = []
    for task_id in range(args.samples):
        start = time.perf_counter()
        event = threading.Event()
        with lock:
            waiting[task_id] = [event, args.tp]
        for push in pushes:
            push.send_multipart([b"%d" % task_id, b"gpu ids", b"cpu ids"])
        event.wait(10)
        latencies.append(time.perf_counter() - start)
    for push in pushes:
        push.send_multipart([b"stop"])
    for pid in children:
        os.waitpid(pid, 0)
    steady = np.array(latencies[len(latencies) // 10:]) * 1e3
    print(f"tp={args.tp}: empty task round trip p50 {np.percentile(steady, 50):.3f} ms, "
          f"p99 {np.percentile(steady, 99):.3f} ms over {len(steady)} samples")
    for name in os.listdir(socket_dir):
        os.unlink(os.path.join(socket_dir, name))
    os.rmdir(socket_dir)


if __name__ == "__main__":
    main()
