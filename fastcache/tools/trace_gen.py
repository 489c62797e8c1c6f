"""python -m fastcache.tools.trace_gen: synthetic request traces of other shapes than the conversation trace.

Writes Mooncake's JSONL format (see /work/shared/traces/README.md; fastcache.tools.trace_model.load_trace
reads it): one request a line with `timestamp` (ms from the first request), `input_length`,
`output_length` (tokens) and `hash_ids`, the prompt's 512-token blocks as a prefix chain. A block's id
stands for the whole token prefix up to its end: blocks of a shared prefix carry the same ids, new content
fresh ones, and a prompt's last partial block always a fresh id of its own (when a prompt grows, the
formerly partial block becomes a new full block with a new id). Ids are numbered 0, 1, ... in order of
first appearance, like the production trace's. The same seed gives the same trace.

The shapes are sessions arriving as a Poisson process (`rate` per second; the defaults make 12,000
requests span about an hour). Parameters (keyword arguments of `generate`, defaults in AGENT/DOCUMENTS/SHIFTS);
token counts drawn lognormal are given by their median and sigma:

agent: LLM agents calling tools. `systems` system prompts (tool descriptions, 4-16 blocks each) with
  Zipf(`zipf`) popularity; a session picks one and adds a task (`task` tokens); it runs `steps` steps
  (many short sessions, a few of up to `max_steps`); a step's prompt is the previous step's whole prompt +
  that step's output (`output` tokens) + a tool result (`tool` tokens: under a block to tens of blocks);
  `think` seconds (tool run and think time, seconds to minutes) pass between steps.
  Reuse comes from the popular system prompts and from each session's growing context: a recency workload
  whose working set is the context of the sessions currently running.

documents: many users asking about documents. A shared instruction prefix (`instruction` tokens) and
  `documents` shared documents (`doc_blocks`: 10-60 blocks, log-uniform) with Zipf(`zipf`) popularity;
  with probability `private` a user brings a document of their own that nobody else reads. A request is
  instruction + document + the user's question (`question`: a uniform token count, the prompt's last 1-2
  blocks); with probability `follow_up` the user asks again `gap` seconds later, extending their own
  chain (previous prompt + answer + question), up to `max_turns` turns. Reuse is by frequency: a few
  popular documents are read over and over, while the private ones stream through a cache once and push
  the popular ones out of an LRU.

shifts: the workload turns over. Sessions of both shapes above (each with its defaults), arriving at
  `rate` per second; for `period` seconds a `share` of them are agent sessions, for the next `period` the
  same share are documents sessions, and so on: a cache's best rule (recency for the agent phases, keeping
  popular documents over private ones streaming past for the documents phases) changes every period.

A cache that never evicts hits 40-80% of each shape's blocks (the tests check this). At the defaults
(12,000 requests, seed 0; LRU: trace_model.simulate with a GPU of 1,000 blocks and the rest below):
  agent:     389,711 blocks, 92,929 distinct, 64 min; never evicts 76.2%; LRU 4k/8k/16k 51.8/68.4/75.0%
  documents: 390,195 blocks, 106,770 distinct, 61 min; never evicts 72.6%; LRU 4k/8k/16k 46.4/61.9/69.3%
  shifts:    386,494 blocks, 99,220 distinct, 54 min; never evicts 74.3%; LRU 4k/8k/16k 45.3/61.8/71.1%

  python -m fastcache.tools.trace_gen --shape agent|documents|shifts [--requests 12000] [--seed 0] --out PATH
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys

import numpy as np

BLOCK = 512     # tokens per block (hash_ids name 512-token blocks)

AGENT = dict(rate=0.9, systems=6, zipf=1.2, task=(2000, 1.0), steps=(2.5, 0.7), max_steps=20,
             output=(150, 0.8), tool=(1500, 1.5), think=(60.0, 1.0))
SHIFTS = dict(rate=1.4, period=900.0, share=0.9)
DOCUMENTS = dict(rate=2.0, instruction=700, documents=200, zipf=1.0, doc_blocks=(10, 60), private=0.35,
                 question=(256, 1024), output=(300, 0.7), follow_up=0.4, max_turns=8, gap=(60.0, 1.0))


class _Ids:
    """Fresh hash ids (renumbered by first appearance once the trace is built)."""

    def __init__(self):
        self.next = 0

    def take(self, n):
        self.next += n
        return list(range(self.next - n, self.next))


def _extend(prefix, tokens, ids):
    """A prefix (tokens, ids of its full blocks) followed by `tokens` new tokens: its full blocks are kept;
    the blocks the new tokens complete, the old partial block among them, are new content: fresh ids."""
    length, full = prefix
    length += tokens
    return length, full + ids.take(length // BLOCK - len(full))


def _request(prefix, output, ids):
    length, full = prefix
    partial = ids.take(1) if length % BLOCK else []    # never reused: a longer prompt makes it a new full block
    return {"input_length": length, "output_length": output, "hash_ids": full + partial}


def _lognormal(rng, median_sigma, lo, hi):
    """A lognormal draw, clipped to [lo, hi] (the bounds keep the rare extreme draw from dominating)."""
    median, sigma = median_sigma
    return float(np.clip(median * np.exp(sigma * rng.standard_normal()), lo, hi))


def _zipf(n, s):
    weights = np.arange(1, n + 1, dtype=float) ** -s
    return weights / weights.sum()


def _agent(rng, ids, p):
    """session(start) -> [(time_s, record)] for the agent shape."""
    systems = [_extend((0, []), int(rng.integers(4 * BLOCK, 16 * BLOCK + 1)), ids) for _ in range(p["systems"])]
    popularity = _zipf(len(systems), p["zipf"])

    def session(start):
        prefix = systems[rng.choice(len(systems), p=popularity)]
        prefix = _extend(prefix, int(_lognormal(rng, p["task"], 20, 16 * BLOCK)), ids)
        steps = int(np.ceil(_lognormal(rng, p["steps"], 1, p["max_steps"])))
        out, t = [], start
        for _ in range(steps):
            output = int(_lognormal(rng, p["output"], 5, 4000))
            out.append((t, _request(prefix, output, ids)))
            prefix = _extend(prefix, output + int(_lognormal(rng, p["tool"], 20, 40 * BLOCK)), ids)
            t += _lognormal(rng, p["think"], 1, 900)
        return out
    return session


def _documents(rng, ids, p):
    """session(start) -> [(time_s, record)] for the documents shape: one user's turns."""
    lo, hi = p["doc_blocks"]

    def doc_tokens():           # log-uniform: short documents more often than long ones
        return int(BLOCK * np.exp(rng.uniform(np.log(lo), np.log(hi))))

    instruction = _extend((0, []), p["instruction"], ids)
    shared = [_extend(instruction, doc_tokens(), ids) for _ in range(p["documents"])]
    popularity = _zipf(len(shared), p["zipf"])

    def session(start):
        if rng.random() < p["private"]:
            prefix = _extend(instruction, doc_tokens(), ids)
        else:
            prefix = shared[rng.choice(len(shared), p=popularity)]
        out, t = [], start
        while True:
            prefix = _extend(prefix, int(rng.integers(*p["question"], endpoint=True)), ids)
            output = int(_lognormal(rng, p["output"], 5, 4000))
            out.append((t, _request(prefix, output, ids)))
            if len(out) >= p["max_turns"] or rng.random() >= p["follow_up"]:
                return out
            prefix = _extend(prefix, output, ids)       # the answer, then the next question
            t += _lognormal(rng, p["gap"], 5, 1800)
    return session


def _shifts(rng, ids, p):
    """session(start) -> [(time_s, record)] for the shifts shape: agent and documents sessions (each shape's
    defaults), the mix turning over every `period` seconds."""
    agent, documents = _agent(rng, ids, AGENT), _documents(rng, ids, DOCUMENTS)

    def session(start):
        agent_phase = int(start // p["period"]) % 2 == 0
        wants_agent = rng.random() < (p["share"] if agent_phase else 1 - p["share"])
        return (agent if wants_agent else documents)(start)
    return session


SHAPES = {"agent": (AGENT, _agent), "documents": (DOCUMENTS, _documents), "shifts": (SHIFTS, _shifts)}


def generate(shape: str, requests: int = 12000, seed: int = 0, sessions: bool = False, **params) -> list[dict]:
    """The first `requests` requests (by time) of a trace of `shape`; params override the shape's defaults.
    With sessions=True each record also names its session (agent session or user, numbered by arrival): not
    part of the trace format, for tests and analysis."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ValueError(f"requests must be a positive int, not {requests!r}")
    defaults, factory = SHAPES[shape]
    unknown = set(params) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {shape} parameters: {', '.join(sorted(unknown))}")
    p = {**defaults, **params}
    rng = np.random.default_rng(seed)
    ids = _Ids()
    session = factory(rng, ids, p)
    events, start, number = [], 0.0, 0
    earliest = []                       # a max-heap (negated) of the first `requests` times so far
    while True:
        start += rng.exponential(1 / p["rate"])
        # Stop once no later session can have a request among the first `requests`: sessions arrive in
        # order, so stopping at the count alone would leave out sessions arriving before the last kept time.
        if len(earliest) == requests and start > -earliest[0]:
            break
        number += 1
        for t, record in session(start):
            events.append((t, number, record))
            if len(earliest) < requests:
                heapq.heappush(earliest, -t)
            elif t < -earliest[0]:
                heapq.heapreplace(earliest, -t)
    events.sort(key=lambda e: e[0])     # stable: a session's steps keep their order
    events = events[:requests]
    renumber, trace = {}, []
    for t, number, record in events:
        hashes = [renumber.setdefault(h, len(renumber)) for h in record["hash_ids"]]
        trace.append({"timestamp": int(round((t - events[0][0]) * 1000)), "input_length": record["input_length"],
                      "output_length": record["output_length"], "hash_ids": hashes})
        if sessions:
            trace[-1]["session"] = number
    return trace


def write(trace, path):
    with open(path, "w") as f:
        f.writelines(json.dumps(record) + "\n" for record in trace)


class _Parser(argparse.ArgumentParser):
    def error(self, message):           # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _at_least(minimum):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value
    return parse


def main(argv=None):
    p = _Parser(prog="python -m fastcache.tools.trace_gen", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--requests", type=_at_least(1), default=12000, help="requests in the trace (default 12000)")
    p.add_argument("--seed", type=_at_least(0), default=0)
    p.add_argument("--out", required=True, help="JSONL file to write")
    args = p.parse_args(argv)
    trace = generate(args.shape, args.requests, args.seed)
    try:
        write(trace, args.out)
    except OSError as exc:
        p.exit(1, f"{p.prog}: cannot write {args.out}: {exc.strerror}\n")
    from .trace_model import infinite
    blocks = [r["hash_ids"] for r in trace]
    print(f"{args.out}: {len(trace)} {args.shape} requests, {sum(map(len, blocks))} blocks "
          f"({len({h for b in blocks for h in b})} distinct), a cache that never evicts hits "
          f"{infinite(blocks).rates()['hit_rate']:.1%}")


if __name__ == "__main__":
    sys.exit(main())
