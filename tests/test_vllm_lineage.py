"""The weights' fingerprint in vLLM's default namespace (fastcache.integrations.vllm.lineage; no vLLM needed):
it names a checkpoint by its content, never by its path or its files' times."""
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from fastcache.integrations.vllm import lineage
from fastcache.integrations.vllm.lineage import LineageError, checkpoint_digest, default_namespace, weight_files


def checkpoint(path, shards=(b"a" * 1000, b"b" * 3000)):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{}")
    for i, data in enumerate(shards):
        with open(os.path.join(path, f"model-{i:05d}.safetensors"), "wb") as f:
            f.write(data)
    return str(path)


def test_the_same_bytes_at_two_paths_and_times_give_one_digest(tmp_path):
    a = checkpoint(tmp_path / "a")
    b = shutil.copytree(a, tmp_path / "b")
    for name in os.listdir(b):
        os.utime(os.path.join(b, name), (1, 1))
    assert checkpoint_digest(a) == checkpoint_digest(str(b))


@pytest.mark.parametrize("where", [0, 499, 999])
def test_one_byte_changed_anywhere_changes_the_digest_even_with_the_old_mtime(tmp_path, monkeypatch, where):
    """Small pieces, so that the byte falls in the first, a middle or the last piece of its file."""
    monkeypatch.setattr(lineage, "PIECE", 256)
    path = checkpoint(tmp_path / "c")
    before = checkpoint_digest(path)
    shard = os.path.join(path, "model-00000.safetensors")
    stat = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(where)
        f.write(b"z")
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert checkpoint_digest(path) != before


def test_names_and_the_split_into_files_count(tmp_path):
    one = checkpoint_digest(checkpoint(tmp_path / "one", shards=(b"ab",)))
    two = checkpoint_digest(checkpoint(tmp_path / "two", shards=(b"a", b"b")))
    renamed = checkpoint(tmp_path / "renamed", shards=(b"ab",))
    os.rename(os.path.join(renamed, "model-00000.safetensors"), os.path.join(renamed, "weights.safetensors"))
    assert len({one, two, checkpoint_digest(renamed)}) == 3


def test_weight_files_follow_vllms_loaders(tmp_path):
    path = checkpoint(tmp_path / "d", shards=(b"x",))
    for name in ("pytorch_model.bin", "README.md", "tokenizer.json"):
        (tmp_path / "d" / name).write_bytes(b"y")
    os.makedirs(tmp_path / "d" / "original")
    (tmp_path / "d" / "original" / "consolidated.00.pth").write_bytes(b"z")
    assert [os.path.basename(f) for f in weight_files(path)] == ["model-00000.safetensors"]   # preferred
    os.remove(os.path.join(path, "model-00000.safetensors"))
    assert [os.path.basename(f) for f in weight_files(path)] == ["pytorch_model.bin"]
    with pytest.raises(LineageError, match="no weight files"):
        weight_files(checkpoint(tmp_path / "e", shards=()))          # config.json alone
    with pytest.raises(LineageError, match="not a local model directory"):
        weight_files(str(tmp_path / "missing"))
    with pytest.raises(LineageError, match="does not read the weights from checkpoint files"):
        weight_files(path, "dummy")


# Directory layouts against which weight_files must pick what vLLM's own loader picks, per load format.
LAYOUTS = {
    "safetensors+pt+bin": ["model.safetensors", "model.pt", "pytorch_model.bin", "optimizer.pt", "scaler.pt"],
    "pt+bin": ["model.pt", "pytorch_model.bin", "training_args.bin", ".hidden.pt"],
    "pt-only": ["model.pt", "scheduler.pt"],
    "bin-only": ["pytorch_model-00001.bin", "pytorch_model-00002.bin", "optimizer.bin"],
    "indexed": ["model-00001.safetensors", "model-00002.safetensors", "consolidated.safetensors-x",
                "stale.safetensors", ("model.safetensors.index.json",
                                      '{"weight_map": {"a": "model-00001.safetensors", "b": "model-00002.safetensors"}}')],
    "mistral": ["consolidated.safetensors", "model-00001.safetensors", ("params.json", "{}")],
    "mistral-indexed": ["consolidated-00001.safetensors", "consolidated-00002.safetensors",
                        ("consolidated.safetensors.index.json", '{"weight_map": {"a": "consolidated-00001.safetensors"}}')],
}
FORMATS = ["auto", "hf", "safetensors", "fastsafetensors", "instanttensor", "mistral", "pt", "npcache"]


def layout(path, files):
    os.makedirs(path)
    for entry in files:
        name, text = entry if isinstance(entry, tuple) else (entry, "w")
        (path / name).write_text(text)
    return str(path)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_weight_files_are_the_files_vllms_loader_reads_for_each_load_format(tmp_path, name):
    """The oracle is vLLM 0.32's own DefaultModelLoader._prepare_weights on the same directory."""
    pytest.importorskip("vllm")
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    path = layout(tmp_path / name, LAYOUTS[name])
    seen = set()
    for fmt in FORMATS:
        try:
            want = sorted(DefaultModelLoader(LoadConfig(load_format=fmt))._prepare_weights(path, None, None,
                                                                                           True, None)[1])
        except (RuntimeError, FileNotFoundError):
            with pytest.raises(LineageError):
                weight_files(path, fmt)
            seen.add("no weights")
            continue
        assert weight_files(path, fmt) == want, fmt
        seen.add(tuple(want))
    assert len(seen) >= 2               # the layout tells formats apart: the check can see a mix-up


@pytest.mark.parametrize("changed", ["model.pt", "pytorch_model.bin", "model.safetensors"])
def test_the_file_the_load_format_reads_changes_the_digest(tmp_path, changed):
    """A model.pt, a pytorch_model.bin and a model.safetensors side by side: each format's digest moves with
    the file that format reads and with no other."""
    reads = {"pt": "model.pt", "npcache": "pytorch_model.bin", "hf": "model.safetensors",
             "auto": "model.safetensors", "safetensors": "model.safetensors"}
    path = layout(tmp_path / "m", ["model.safetensors", "model.pt", "pytorch_model.bin"])
    before = {f: checkpoint_digest(path, f) for f in reads}
    (tmp_path / "m" / changed).write_text("new weights")
    for f, read in reads.items():
        assert (checkpoint_digest(path, f) != before[f]) == (read == changed), f


def test_npcache_digest_covers_the_numpy_copies_it_serves(tmp_path):
    """After its first load, npcache reads np/ (not the .bin): a changed copy there changes the digest."""
    path = layout(tmp_path / "m", ["pytorch_model.bin"])
    bare = checkpoint_digest(path, "npcache")
    os.makedirs(tmp_path / "m" / "np")
    (tmp_path / "m" / "np" / "weight_names.json").write_text('["w.a", "w.b"]')
    for n in ("w.a", "w.b"):
        (tmp_path / "m" / "np" / n).write_bytes(b"\x93NUMPY" + n.encode())
    cached = checkpoint_digest(path, "npcache")
    (tmp_path / "m" / "np" / "w.b").write_bytes(b"\x93NUMPYother")
    assert len({bare, cached, checkpoint_digest(path, "npcache")}) == 3


def test_file_sizes_frame_the_pieces(tmp_path, monkeypatch):
    """f1 = X+Y, f2 = Z against f1 = X, f2 = Y+Z, every piece one PIECE long: the same piece digests in the
    same order, told apart only by the sizes."""
    monkeypatch.setattr(lineage, "PIECE", 4)
    x, y, z = b"XXXX", b"YYYY", b"ZZZZ"
    one = checkpoint(tmp_path / "one", shards=(x + y, z))
    two = checkpoint(tmp_path / "two", shards=(x, y + z))
    pieces = [[lineage._piece_digest((os.path.join(p, f), off, 4)) for f, offs in
               (("model-00000.safetensors", lengths[0]), ("model-00001.safetensors", lengths[1])) for off in offs]
              for p, lengths in ((one, ((0, 4), (0,))), (two, ((0,), (0, 4))))]
    assert pieces[0] == pieces[1]                   # the pieces alone cannot tell them apart
    assert checkpoint_digest(one) != checkpoint_digest(two)


def test_the_namespace_binds_the_digest_and_every_part(tmp_path):
    parts = {"kv_dtype": "bfloat16", "hf_config": {"num_hidden_layers": 4}}
    ns = default_namespace("org/model", "d1", parts)
    assert ns.startswith("org/model/w") and ns == default_namespace("org/model", "d1", dict(reversed(parts.items())))
    assert ns != default_namespace("org/model", "d2", parts)
    assert ns != default_namespace("org/model", "d1", {**parts, "kv_dtype": "fp8"})
    assert ns != default_namespace("org/model", "d1", {**parts, "hf_config": {"num_hidden_layers": 5}})
    long = default_namespace("/x" * 400, "d1", parts)
    assert len(long) < 256 and long.isprintable()


def test_mixed_key_types_are_a_clear_error():
    with pytest.raises(LineageError, match="mixes key types"):
        default_namespace("m", "d1", {"hf_config": {1: "a", "b": 2}})


def test_a_weight_file_gone_before_it_is_read_is_an_error_naming_it(tmp_path, monkeypatch):
    path = checkpoint(tmp_path / "c")
    listed = weight_files

    def listed_then_removed(*args):
        files = listed(*args)
        os.remove(files[-1])
        return files
    monkeypatch.setattr(lineage, "weight_files", listed_then_removed)
    with pytest.raises(LineageError, match="cannot read weight file .*model-00001.safetensors"):
        checkpoint_digest(path)


# A child hashes a checkpoint of 3 pieces with one thread; its hashing truncates the file it hashes first.
CUT_WHILE_HASHED = r"""
import os, sys, xxhash
from fastcache.integrations.vllm import lineage
lineage.PIECE = 1 << 16
path, victim = sys.argv[1], sys.argv[2]
real, cut = xxhash, []

class Cutting:
    def _cut(self):
        if not cut:
            cut.append(os.truncate(victim, 100))
    def xxh3_128_digest(self, data):
        self._cut()
        return real.xxh3_128_digest(data)
    def xxh3_128(self, *args):
        self._cut()
        return real.xxh3_128(*args)
lineage.xxhash = Cutting() if victim else real
try:
    print(lineage.checkpoint_digest(path, threads=1))
except lineage.LineageError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
"""


def test_a_checkpoint_truncated_while_hashed_is_an_error_not_a_signal(tmp_path, monkeypatch):
    monkeypatch.setattr(lineage, "PIECE", 1 << 16)
    data = os.urandom(3 << 16)
    path = checkpoint(tmp_path / "c", shards=(data,))
    victim = os.path.join(path, "model-00000.safetensors")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    whole = subprocess.run([sys.executable, "-c", CUT_WHILE_HASHED, path, ""], capture_output=True, text=True,
                           timeout=120, env=env)
    assert whole.returncode == 0 and whole.stdout.strip() == checkpoint_digest(path), whole.stderr
    cut = subprocess.run([sys.executable, "-c", CUT_WHILE_HASHED, path, victim], capture_output=True, text=True,
                         timeout=120, env=env)
    assert os.path.getsize(victim) == 100                 # the hook ran
    assert cut.returncode == 3, (cut.returncode, cut.stderr)          # not -7 (SIGBUS)
    assert "changed while it was hashed" in cut.stderr and "model-00000.safetensors" in cut.stderr


def test_a_file_changed_while_hashed_without_a_short_read_is_caught(tmp_path, monkeypatch):
    """The same size, other bytes, written between two pieces: the file's status after the hash differs."""
    monkeypatch.setattr(lineage, "PIECE", 256)
    path = checkpoint(tmp_path / "c")
    victim = os.path.join(path, "model-00001.safetensors")
    real = lineage._piece_digest
    calls = []

    def rewrite_after_the_first(job):
        calls.append(job)
        if len(calls) == 2:
            with open(victim, "r+b") as f:
                f.write(b"Z")
        return real(job)
    monkeypatch.setattr(lineage, "_piece_digest", rewrite_after_the_first)
    with pytest.raises(LineageError, match="model-00001.safetensors' changed while it was hashed"):
        checkpoint_digest(path, threads=1)
    assert len(calls) == 16                                 # every piece was read: only the status saw it


# A child that starts, says so, and hashes once told to: the way a vLLM worker loads, then hashes.
HASH_SINCE_START = r"""
import sys
from fastcache.integrations.vllm import lineage
print("started", flush=True)
sys.stdin.readline()
try:
    print(lineage.checkpoint_digest(sys.argv[1], not_changed_since=lineage.process_start_ns()))
except lineage.LineageError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
"""


@pytest.mark.parametrize("write", [False, True], ids=["unchanged", "written-after-start"])
def test_a_weight_file_written_after_the_process_started_cannot_be_named(tmp_path, write):
    path = checkpoint(tmp_path / "c")
    digest = checkpoint_digest(path)
    written = max(os.stat(f).st_ctime_ns for f in weight_files(path))
    while time.time_ns() < written + 2 * lineage.CLOCK_SLACK_NS:     # the child starts after the slack
        time.sleep(0.005)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", HASH_SINCE_START, path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline() == "started\n"
        if write:                       # the same bytes rewritten: only the time says the load may differ
            shard = os.path.join(path, "model-00000.safetensors")
            data = open(shard, "rb").read()
            with open(shard, "wb") as f:
                f.write(data)
        out, err = child.communicate("go\n", timeout=120)
    finally:
        child.kill()
        child.wait()
    if write:
        assert child.returncode == 3 and "changed (ctime" in err and "model-00000.safetensors" in err, err
    else:
        assert child.returncode == 0 and out.strip() == digest, err


# -- the namespace vLLM's worker takes (fastcache.integrations.vllm.spec, needs vLLM) -----------------------

def fake_vllm_config(path, quantization=None, load_format="auto"):
    hf = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "_name_or_path": path}
    model = SimpleNamespace(model=path, revision=None, dtype="bfloat16", quantization=quantization,
                            hf_config=SimpleNamespace(to_dict=lambda: dict(hf)))
    return SimpleNamespace(model_config=model, load_config=SimpleNamespace(load_format=load_format,
                                                                          download_dir=None))


@pytest.fixture
def spec(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.config
    from fastcache.integrations.vllm import spec
    configs = []
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: configs[-1])
    # The weights were loaded after the checkpoint was written (the test process itself is older).
    monkeypatch.setattr(spec, "process_start_ns", lambda: loaded[-1])
    loaded = [time.time_ns()]

    def namespace(*args, loaded_at=None, **kwargs):
        configs.append(fake_vllm_config(*args, **kwargs))
        loaded.append(loaded_at if loaded_at is not None else time.time_ns())
        return spec.weights_namespace("model", "bfloat16")
    return namespace


def test_the_quantization_is_in_the_namespace(tmp_path, spec):
    path = checkpoint(tmp_path / "c")
    plain = spec(path)
    assert plain.startswith("LlamaForCausalLM/w") and plain == spec(path)        # named by content, stably
    assert plain == spec(shutil.copytree(path, tmp_path / "copy"))
    fp8 = spec(path, quantization="fp8")
    assert len({plain, fp8, spec(path, quantization="awq")}) == 3
    assert "/engine-" in spec(path, load_format="dummy")        # not read from files: this engine's alone


def test_a_weight_file_changed_after_the_load_began_gets_a_namespace_of_its_own(tmp_path, spec):
    path = checkpoint(tmp_path / "c")
    before_write = time.time_ns() - lineage.CLOCK_SLACK_NS
    with open(os.path.join(path, "model-00001.safetensors"), "ab") as f:
        f.write(b"new")
    alone = spec(path, loaded_at=before_write)
    assert "/engine-" in alone and alone != spec(path, loaded_at=before_write)
    named = spec(path)                                      # control: loaded after the write, named by content
    assert named.startswith("LlamaForCausalLM/w") and named == spec(path)


def test_lora_adapters_are_kept_apart_by_vllms_block_hash():
    """LoRA adapters are loaded per request, after the namespace is fixed; what keeps KV computed under one
    adapter from being served for another is vLLM's block hash, which carries the adapter's name and path
    (and hence the offload key fastcache stores under)."""
    pytest.importorskip("vllm")
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_offload.base import make_offload_key
    kv_cache_utils.init_none_hash(sha256_cbor)

    def key(lora):
        request = SimpleNamespace(lora_request=lora, mm_features=None, cache_salt=None, prompt_embeds=None)
        extra, _ = kv_cache_utils.generate_block_hash_extra_keys(request, 0, 16, 0)
        return make_offload_key(kv_cache_utils.hash_block_tokens(sha256_cbor, None, list(range(16)), extra), 0)

    def lora(name, path):
        return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=1)
    keys = [key(None), key(lora("a", "/ckpt/a")), key(lora("b", "/ckpt/a")), key(lora("a", "/ckpt/a2"))]
    assert len(set(keys)) == 4                 # base, adapter, another name, the same name re-pointed
    assert key(lora("a", "/ckpt/a")) == keys[1]     # the oracle is stable: the same adapter shares
