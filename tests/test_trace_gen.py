"""python -m fastcache.tools.trace_gen: synthetic traces that load_trace reads, deterministic for a seed, whose
hash ids are a consistent prefix chain and whose shapes have the structure the module's docstring claims."""
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from fastcache.tools.trace_gen import AGENT, BLOCK, generate, write
from fastcache.tools.trace_model import infinite, load_trace

SHAPES = ("agent", "documents", "shifts")
N = 3000        # requests per test trace: enough for the shapes' statistics, well under a second each


@pytest.fixture(scope="module")
def traces():
    return {shape: generate(shape, N, seed=1, sessions=True) for shape in SHAPES}


def by_session(trace):
    sessions = defaultdict(list)
    for r in trace:
        sessions[r["session"]].append(r)
    return list(sessions.values())


def full(r):
    """The ids of a request's full blocks (a partial last block is not reusable)."""
    return r["hash_ids"][:r["input_length"] // BLOCK]


def common_prefix(chains):
    n = 0
    while all(len(c) > n and c[n] == chains[0][n] for c in chains):
        n += 1
    return n


# -- both shapes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_deterministic(shape):
    assert generate(shape, 500, seed=7) == generate(shape, 500, seed=7)
    assert generate(shape, 500, seed=7) != generate(shape, 500, seed=8)


@pytest.mark.parametrize("shape", SHAPES)
def test_loads(shape, traces, tmp_path):
    trace = generate(shape, N, seed=1)
    write(trace, tmp_path / "t.jsonl")
    loaded = load_trace(str(tmp_path / "t.jsonl"))
    assert loaded.requests == [r["hash_ids"] for r in trace]
    assert list(loaded.timestamps) == [r["timestamp"] for r in trace]
    # the session labels are extra: without them the trace is the same
    assert [{k: v for k, v in r.items() if k != "session"} for r in traces[shape]] == trace


@pytest.mark.parametrize("shape", SHAPES)
def test_well_formed(shape, traces):
    trace = traces[shape]
    assert len(trace) == N
    stamps = [r["timestamp"] for r in trace]
    assert stamps[0] == 0 and all(type(t) is int for t in stamps)
    assert all(a <= b for a, b in zip(stamps, stamps[1:]))
    assert stamps[-1] > 5 * 60e3                   # sessions spread over minutes, not a burst
    place = {}                                      # id -> (position, the id before it)
    partials = Counter()
    for r in trace:
        h = r["hash_ids"]
        assert len(h) == -(-r["input_length"] // BLOCK) and r["output_length"] > 0
        assert len(set(h)) == len(h) and all(type(x) is int and 0 <= x < 2**63 for x in h)
        for i, x in enumerate(h):                   # a prefix chain: an id stands for its whole prefix
            assert place.setdefault(x, (i, h[i - 1] if i else None)) == (i, h[i - 1] if i else None)
        if r["input_length"] % BLOCK:
            partials[h[-1]] += 1
    # a partial block's id is never anybody's full block, nor another request's partial one
    everywhere = Counter(x for r in trace for x in r["hash_ids"])
    assert partials and all(everywhere[x] == 1 for x in partials)


@pytest.mark.parametrize("shape", SHAPES)
def test_infinite_cache_hit_rate_as_documented(shape, traces):
    rate = infinite([r["hash_ids"] for r in traces[shape]]).rates()["hit_rate"]
    assert 0.40 <= rate <= 0.80, rate


@pytest.mark.parametrize("shape", SHAPES)
def test_steps_extend_the_session_chain(shape, traces):
    """A later step's prompt starts with the earlier step's full blocks, then only new ids; it grew by at
    least the earlier output (agent: + a tool result; documents: + the next question)."""
    grown = []
    for steps in by_session(traces[shape]):
        for a, b in zip(steps, steps[1:]):
            assert b["timestamp"] > a["timestamp"]
            assert b["hash_ids"][:len(full(a))] == full(a)
            assert not set(b["hash_ids"][len(full(a)):]) & set(a["hash_ids"])
            grown.append(b["input_length"] - a["input_length"] - a["output_length"])
    assert grown and min(grown) >= 20
    if shape == "agent":       # tool results from under a block to tens of blocks
        assert min(grown) < BLOCK and max(grown) > 10 * BLOCK


# -- agent -------------------------------------------------------------------------------------------
def test_agent_system_prompts_shared(traces):
    firsts = [steps[0] for steps in by_session(traces["agent"])]
    systems = defaultdict(list)                    # first id: the system prompt's first block
    for r in firsts:
        systems[r["hash_ids"][0]].append(r["hash_ids"])
    assert 2 <= len(systems) <= AGENT["systems"]
    popular = sorted(systems.values(), key=len, reverse=True)
    assert len(popular[0]) > 3 * len(popular[-1])          # Zipf-like popularity
    for chains in popular[:2]:
        shared = common_prefix(chains)              # the system prompt: 4-16 blocks, then each session's own
        assert 4 <= shared <= 16
        assert len({c[shared] for c in chains}) == len(chains) > 20


def test_agent_session_lengths_vary(traces):
    lengths = [len(steps) for steps in by_session(traces["agent"])]
    assert sum(n <= 2 for n in lengths) > 0.3 * len(lengths) and max(lengths) >= 10


# -- documents ---------------------------------------------------------------------------------------
def test_documents_shared_across_users(traces):
    firsts = [steps[0]["hash_ids"] for steps in by_session(traces["documents"])]
    assert len({h[0] for h in firsts}) == 1        # the shared instruction's block
    documents = defaultdict(list)                  # block 1: the instruction's tail and the document's head
    for h in firsts:
        documents[h[1]].append(h)
    popular = sorted(documents.values(), key=len, reverse=True)
    assert len(popular[0]) > 0.05 * len(firsts)    # Zipf: the top document draws many users
    assert sum(len(c) == 1 for c in popular) > 0.2 * len(firsts)   # private documents: read once
    for chains in popular[:5]:
        shared = common_prefix(chains)              # instruction + document (>= 10 blocks), same ids for all
        assert shared >= 11
        assert len({c[shared] for c in chains}) == len(chains)     # then each user's own question


def test_documents_follow_ups(traces):
    turns = [len(steps) for steps in by_session(traces["documents"])]
    assert 0.15 * len(turns) < sum(n > 1 for n in turns) < 0.6 * len(turns)


# -- shifts ------------------------------------------------------------------------------------------
def test_shifts_turn_the_mix_over_every_period():
    """Agent sessions (under one of a few system prompts) and documents sessions (all under one instruction)
    take turns: most sessions of an even period are agent sessions, most of an odd one documents sessions."""
    period = 120.0
    trace = generate("shifts", N, seed=1, sessions=True, period=period)
    firsts = [steps[0] for steps in by_session(trace)]
    instruction = Counter(r["hash_ids"][0] for r in firsts).most_common(1)[0][0]    # documents' first block
    documents = defaultdict(list)                   # period -> a documents session or not, per session
    for r in firsts:
        at = r["timestamp"] / 1e3 / period
        if 0.1 < at % 1 < 0.9:                      # clear of a turnover (timestamps start at the first one)
            documents[int(at)].append(r["hash_ids"][0] == instruction)
    shares = {p: sum(d) / len(d) for p, d in documents.items() if len(d) >= 20}
    assert len(shares) >= 4, shares
    assert all((share < 0.3) if p % 2 == 0 else (share > 0.7) for p, share in shares.items()), shares


# -- the command line --------------------------------------------------------------------------------
def run(*args):
    return subprocess.run([sys.executable, "-m", "fastcache.tools.trace_gen", *args], capture_output=True,
                          text=True, timeout=60)


def test_cli_writes_the_trace(tmp_path):
    out = tmp_path / "docs.jsonl"
    proc = run("--shape", "documents", "--requests", "300", "--seed", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "300 documents requests" in proc.stdout
    assert load_trace(str(out)).requests == [r["hash_ids"] for r in generate("documents", 300, seed=3)]


@pytest.mark.parametrize("args, says", [
    (["--shape", "agent", "--requests", "0"], "at least 1"),
    (["--shape", "agent", "--requests", "many"], "not an integer"),
    (["--shape", "agent", "--requests", "10", "--seed", "-1"], "at least 0"),
    (["--shape", "chat", "--requests", "10"], "invalid choice"),
    (["--requests", "10"], "--shape"),
    (["--shape", "agent", "--requests", "10", "--out", "/nonexistent/dir/t.jsonl"], "cannot write"),
])
def test_cli_refuses(args, says, tmp_path):
    if "--out" not in args:
        args = [*args, "--out", str(tmp_path / "t.jsonl")]
    proc = run(*args)
    assert proc.returncode != 0 and proc.stdout == ""
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_generate_refuses():
    with pytest.raises(ValueError, match="positive"):
        generate("agent", 0)
    with pytest.raises(ValueError, match="unknown shape"):
        generate("chat", 10)
    with pytest.raises(ValueError, match="unknown agent parameters: bogus"):
        generate("agent", 10, bogus=1)
