"""The weights' fingerprint in vLLM's default namespace (fastcache.integrations.vllm.lineage; no vLLM needed):
it names a checkpoint by its content, never by its path or its files' times."""
import os
import shutil

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
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"g")
    assert weight_files(str(gguf)) == [str(gguf)]
    with pytest.raises(LineageError, match="no weight files"):
        weight_files(checkpoint(tmp_path / "e", shards=()))          # config.json alone
    with pytest.raises(LineageError, match="not a local file or directory"):
        weight_files(str(tmp_path / "missing"))


def test_the_namespace_binds_the_digest_and_every_part(tmp_path):
    parts = {"kv_dtype": "bfloat16", "hf_config": {"num_hidden_layers": 4}}
    ns = default_namespace("org/model", "d1", parts)
    assert ns.startswith("org/model/w") and ns == default_namespace("org/model", "d1", dict(reversed(parts.items())))
    assert ns != default_namespace("org/model", "d2", parts)
    assert ns != default_namespace("org/model", "d1", {**parts, "kv_dtype": "fp8"})
    assert ns != default_namespace("org/model", "d1", {**parts, "hf_config": {"num_hidden_layers": 5}})
    long = default_namespace("/x" * 400, "d1", parts)
    assert len(long) < 256 and long.isprintable()
