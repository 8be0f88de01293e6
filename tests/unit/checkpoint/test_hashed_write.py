"""How a checkpoint's bytes reach the disk (``pretrain/checkpoint/hashed_write.py``): a file hashed as it is written
(direct I/O where the filesystem allows it, buffered where not)."""

from __future__ import annotations

import errno
import hashlib

import pytest
import torch

from pretrain.checkpoint import hashed_write
from pretrain.checkpoint.hash_tally import hash_tally
from pretrain.checkpoint.hashed_write import CHUNK, HashingFile


def _state(nbytes: int) -> dict:
    return {"big": torch.arange(nbytes // 4, dtype=torch.float32), "small": torch.arange(7), "meta": {"step": 3}}


@pytest.mark.parametrize("nbytes", [0, 100, hashed_write.ALIGN, CHUNK, 3 * CHUNK + 12_345])
@pytest.mark.parametrize("direct", [True, False])
def test_hashing_file_digest_is_the_files_and_torch_loads_it(tmp_path, nbytes, direct):
    path = tmp_path / "f.pt"
    with HashingFile(path, direct) as f:
        torch.save(_state(nbytes), f)
        digest = f.close()
    assert f.direct is direct  # this filesystem (the tests') takes O_DIRECT
    data = path.read_bytes()
    assert digest == hashlib.sha256(data).hexdigest() and f.nbytes == len(data)
    back = torch.load(path, weights_only=True)
    assert torch.equal(back["big"], _state(nbytes)["big"]) and back["meta"] == {"step": 3}


def test_direct_and_buffered_files_are_the_same_bytes(tmp_path):
    digests = []
    for direct in (True, False):
        with HashingFile(tmp_path / f"{direct}.pt", direct) as f:
            torch.save(_state(CHUNK + 999), f)
            digests.append(f.close())
    assert digests[0] == digests[1]
    assert (tmp_path / "True.pt").read_bytes() == (tmp_path / "False.pt").read_bytes()


def test_a_filesystem_without_direct_io_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = hashed_write.os.open

    def refusing_open(path, flags, *args):
        if flags & hashed_write.os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(hashed_write.os, "open", refusing_open)
    with HashingFile(tmp_path / "f.pt", direct=True) as f:
        torch.save(_state(CHUNK), f)
        digest = f.close()
    assert not f.direct
    assert digest == hashlib.sha256((tmp_path / "f.pt").read_bytes()).hexdigest()


def test_a_refused_direct_write_writes_on_without_direct_io(tmp_path, monkeypatch):
    real_pwrite, refused = hashed_write.os.pwrite, []

    def pwrite(fd, data, offset):
        if hashed_write.fcntl.fcntl(fd, hashed_write.fcntl.F_GETFL) & hashed_write.os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(hashed_write.os, "pwrite", pwrite)
    with HashingFile(tmp_path / "f.pt", direct=True) as f:
        torch.save(_state(2 * CHUNK), f)
        digest = f.close()
    assert refused == [0]  # the first write: then the descriptor wrote on without O_DIRECT
    data = (tmp_path / "f.pt").read_bytes()
    assert digest == hashlib.sha256(data).hexdigest() and len(data) == f.nbytes
    assert torch.equal(torch.load(tmp_path / "f.pt", weights_only=True)["big"], _state(2 * CHUNK)["big"])


def test_hash_tally_counts_what_was_hashed_while_written(tmp_path):
    before = hash_tally()
    with HashingFile(tmp_path / "f.pt") as f:
        torch.save(_state(CHUNK), f)
        f.close()
    assert (hash_tally() - before).bytes == (tmp_path / "f.pt").stat().st_size


def test_a_failed_save_leaves_no_digest_and_closes_the_file(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        with HashingFile(tmp_path / "f.pt") as f:
            torch.save({"big": torch.zeros(CHUNK // 2), "bad": Unpicklable()}, f)
            f.close()
    assert f._fd is None  # closed by the context manager
