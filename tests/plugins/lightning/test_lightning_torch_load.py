"""Issue #30: a Lightning ``.ckpt`` written by unickpt is a file ``torch.load`` reads.

The pack is ``torch.save``'s zip archive (``unickpt.lightning._torchzip``): ``torch.load(path)`` gives
the checkpoint dict Lightning's own IO writes (bitwise tensors, types, key order, Parameters,
``requires_grad``, ``OrderedDict._metadata``, tied tensors one object), with ``weights_only=True`` and
``mmap=True``; unickpt reads the same bytes by byte range (each tensor stored once), and still reads
the packs of format 1.
"""
from __future__ import annotations

import collections
import json
import os
import struct
import zipfile

import pytest
import torch

from test_lightning import assert_same, lightning_like_checkpoint
from unickpt.lightning import UnickptCheckpointIO, _pack, _torchzip


class Opaque:
    """A class torch.load's weights_only mode refuses."""

    def __eq__(self, other):
        return type(other) is type(self)


def _save(tmp_path, ckpt, name="epoch=3-step=12.ckpt", **kw):
    io = UnickptCheckpointIO(**kw)
    path = tmp_path / name
    io.save_checkpoint(ckpt, path)
    io.teardown()
    return io, path


def _all_dtypes() -> dict:
    g = torch.Generator().manual_seed(1)
    out = {}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
               torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
               torch.uint16, torch.uint32):
        raw = torch.randint(0, 256, (32,), dtype=torch.uint8, generator=g)
        size = torch.empty(0, dtype=dt).element_size()
        out[str(dt)] = raw[: 32 // size * size].view(dt).reshape(2, -1) if dt != torch.bool else raw[:6] % 2 == 1
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.empty(0, 3)
    out["view"] = torch.arange(20.0).reshape(4, 5)[1:, 2:]  # not contiguous, offset into its storage
    return out


@pytest.mark.parametrize("async_save", [True, False])
def test_torch_load_reads_the_checkpoint_dict_lightning_writes(tmp_path, async_save):
    ckpt = lightning_like_checkpoint()
    ckpt["dtypes"] = _all_dtypes()
    io, path = _save(tmp_path, ckpt, async_save=async_save)
    ours = torch.load(path, weights_only=False)
    assert_same(ckpt, ours)
    assert ours["state_dict"]._metadata == ckpt["state_dict"]._metadata and ours["state_dict"]._metadata
    assert isinstance(ours["extras"]["param"], torch.nn.Parameter) and ours["extras"]["grad"].requires_grad
    assert ours["extras"]["tied"][0] is ours["extras"]["tied"][1]  # one storage, one object, as torch.save
    assert list(ours["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert_same(ckpt, torch.load(path, weights_only=False, mmap=True))  # records 64-byte aligned
    assert_same(io.load_checkpoint(path), ours)  # unickpt reads the same checkpoint
    with zipfile.ZipFile(path) as z:  # a well-formed zip: every record's CRC-32 checks
        assert z.testzip() is None
        names = z.namelist()
        assert names[0] == "archive/.unickpt/pack" and "archive/data.pkl" in names and "archive/version" in names
        for info in z.infolist():
            if info.filename.startswith("archive/data/"):
                with open(path, "rb") as f:
                    f.seek(info.header_offset + 26)
                    n, m = struct.unpack("<HH", f.read(4))
                assert (info.header_offset + 30 + n + m) % 64 == 0, info.filename


def test_weights_only_loads_as_it_does_for_lightning_s_own_file(tmp_path):
    """torch.load's default (weights_only=True) accepts our file exactly when it accepts torch.save's."""
    ckpt = lightning_like_checkpoint()
    _, path = _save(tmp_path, ckpt)
    torch.save(ckpt, tmp_path / "own.pt")
    assert_same(torch.load(tmp_path / "own.pt"), torch.load(path))

    ckpt["hyper_parameters"]["obj"] = Opaque()
    _, path2 = _save(tmp_path, ckpt, name="opaque.ckpt", allow_pickle=True)
    torch.save(ckpt, tmp_path / "own2.pt")
    for p in (tmp_path / "own2.pt", path2):
        with pytest.raises(Exception, match="Weights only load failed"):
            torch.load(p)
    assert_same(torch.load(tmp_path / "own2.pt", weights_only=False), torch.load(path2, weights_only=False))


def test_each_tensor_byte_is_stored_once(tmp_path):
    big = {f"w{i}": torch.randn(256, 256) for i in range(4)}  # 1 MiB of tensors
    ckpt = {"state_dict": big, "epoch": 0, "global_step": 1}
    _, path = _save(tmp_path, ckpt)
    tensor_bytes = sum(t.numel() * t.element_size() for t in big.values())
    assert tensor_bytes <= os.path.getsize(path) < tensor_bytes + 64 * 1024
    with _pack.open_pack(str(path)) as (url, index):
        assert index["format_version"] == 2 and list(index["files"]) == ["metadata.json"]
        assert set(index["virtual"]) == {"data/0_0.bin"}  # unickpt's data file: parts of the tensor records
        from unickpt.storage import open_storage

        meta = json.loads(open_storage(url).read_bytes(f"{url}/metadata.json"))
        with zipfile.ZipFile(path) as z:
            for fqn, t in big.items():
                chunk = meta["tensors"][f"tensors.state_dict.{fqn}"]["chunks"][0]
                got = open_storage(url).read_bytes(f"{url}/{chunk['file']}")[chunk["byte_offset"]:][:chunk["byte_length"]]
                assert got == t.numpy().tobytes()
                assert any(z.read(n) == got for n in z.namelist() if n.startswith("archive/data/"))


def test_zip64_records_and_end_records(tmp_path, monkeypatch):
    """The zip64 fields (sizes and offsets from 4 GiB, 65535 records and more), forced at small sizes."""
    monkeypatch.setattr(_torchzip, "_ZIP64_AT", 16)
    monkeypatch.setattr(_torchzip, "_COUNT64_AT", 3)
    ckpt = lightning_like_checkpoint()
    io, path = _save(tmp_path, ckpt)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
        assert any(len(i.extra) > 0 and i.file_size >= 16 for i in z.infolist())
    with open(path, "rb") as f:
        assert b"PK\x06\x06" in f.read()  # the zip64 end record
    assert_same(ckpt, torch.load(path, weights_only=False))
    assert_same(ckpt, io.load_checkpoint(path))


def test_a_pack_of_format_1_is_still_read(tmp_path):
    ckpt = lightning_like_checkpoint()
    io, path = _save(tmp_path, ckpt)
    from unickpt.storage import open_storage

    with _pack.open_pack(str(path)) as (url, index):  # the members, rewritten in the format 1 layout
        store = open_storage(url)
        names = [n for n in (*index["files"], *index["virtual"]) if n != "metadata.json"] + ["metadata.json"]
        members = {n: store.read_bytes(f"{url}/{n}") for n in names}
    body, files, off = [], {}, len(_pack.MAGIC)
    for n in names:
        files[n] = [off, len(members[n])]
        body.append(members[n])
        off += len(members[n])
    raw = json.dumps({"format": "unickpt-lightning-pack", "format_version": 1, "files": files}).encode()
    old = tmp_path / "old.ckpt"
    old.write_bytes(_pack.MAGIC + b"".join(body) + raw + struct.pack("<QQ", off, len(raw)) + _pack.MAGIC)
    assert _pack.kind(str(old)) == "pack"
    assert_same(ckpt, io.load_checkpoint(old))


def test_a_truncated_pack_is_refused_by_both_readers(tmp_path):
    io, path = _save(tmp_path, lightning_like_checkpoint())
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="damaged unickpt checkpoint file"):
        io.load_checkpoint(path)
    with pytest.raises((RuntimeError, OSError)):  # torch's own reader: no central directory
        torch.load(path, weights_only=False)


def test_a_layout_that_maps_onto_no_byte_ranges_is_copied_into_its_record():
    """A tensor stored as column blocks (no unickpt save of the io route writes one today) cannot be a
    list of byte ranges in row-major order: its record is assembled, and its data file stays a record."""
    t = torch.arange(12.0).reshape(3, 4)
    left, right = t[:, :2].contiguous().numpy().tobytes(), t[:, 2:].contiguous().numpy().tobytes()
    files = {"data/0_0.bin": right + left}
    meta = {"tensors": {"tensors.w": {"dtype": "float32", "shape": [3, 4], "chunks": [
        {"offsets": [0, 0], "lengths": [3, 2], "file": "data/0_0.bin", "byte_offset": 24, "byte_length": 24},
        {"offsets": [0, 2], "lengths": [3, 2], "file": "data/0_0.bin", "byte_offset": 0, "byte_length": 24}]}}}
    records, virtual = _torchzip.map_data_files(meta, {"data/0_0.bin": 48}, {"0": "w"}, lambda f, g: True)
    assert records == {"0": None} and virtual == {}
    raw = _torchzip.assemble(meta["tensors"]["tensors.w"], lambda f, o, n: files[f][o:o + n])
    assert raw == t.numpy().tobytes()
    # row slabs in order do map, across two files, with zero padding between parts
    meta2 = {"tensors": {"tensors.w": {"dtype": "float32", "shape": [3, 4], "chunks": [
        {"offsets": [2, 0], "lengths": [1, 4], "file": "data/1_0.bin", "byte_offset": 0, "byte_length": 16},
        {"offsets": [0, 0], "lengths": [2, 4], "file": "data/0_0.bin", "byte_offset": 64, "byte_length": 32}]}}}
    records, virtual = _torchzip.map_data_files(meta2, {"data/0_0.bin": 96, "data/1_0.bin": 16}, {"0": "w"},
                                                lambda f, gaps: gaps in ([[0, 64]], []))
    assert records == {"0": [["data/0_0.bin", 64, 32], ["data/1_0.bin", 0, 16]]}
    assert virtual["data/0_0.bin"].parts == [[64, 32, "0", 0]] and virtual["data/1_0.bin"].parts == [[0, 16, "0", 32]]
    _, kept = _torchzip.map_data_files(meta2, {"data/0_0.bin": 96, "data/1_0.bin": 16}, {"0": "w"},
                                       lambda f, gaps: not gaps)  # padding that is not zeros: a real record
    assert set(kept) == {"data/1_0.bin"}


def test_an_ordered_dict_and_parameter_pickle_as_torch_save_pickles_them():
    sd = collections.OrderedDict(w=torch.nn.Parameter(torch.ones(2)))
    sd._metadata = {"": {"version": 2}}
    from unickpt.lightning._tree import split

    tree, tensors = split({"sd": sd})
    pickled = _torchzip.pickle_checkpoint(tree, tensors)
    assert pickled.storages == {"0": "sd.w"}
    assert b"_rebuild_parameter" in pickled.data_pkl and b"FloatStorage" in pickled.data_pkl
    assert b"_metadata" in pickled.data_pkl


def test_a_flipped_bit_outside_the_tensors_is_refused_by_unickpt_s_reader(tmp_path):
    """unickpt's checksums cover the tensor bytes; the CRC-32s the archive records cover the metadata
    (epoch, global_step, hyper-parameters) and the index: one flipped bit there is an error, never a
    different dict."""
    from unickpt import IntegrityError

    io, path = _save(tmp_path, {"epoch": 1, "global_step": 7, "state_dict": {"w": torch.ones(3)},
                                "hyper_parameters": {"lr": 0.5}})
    data = bytearray(path.read_bytes())
    with _pack.open_pack(str(path)) as (_url, index):
        off, size, _crc = index["files"]["metadata.json"]
    at = data.index(b'"lr"', off, off + size)  # in the metadata record's state tree
    flipped = bytearray(data)
    flipped[at + 1] ^= 0x01  # "lr" -> "mr"
    path.write_bytes(bytes(flipped))
    with pytest.raises(IntegrityError, match="member 'metadata.json' fails its CRC-32"):
        io.load_checkpoint(path)
    index_at = data.rindex(b'"global_step":7')  # the index record's copy of the step
    flipped = bytearray(data)
    flipped[index_at + len('"global_step":')] = ord("6")
    path.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="its index fails its CRC-32"):
        io.load_checkpoint(path)
    path.write_bytes(bytes(data))
    assert io.load_checkpoint(path)["hyper_parameters"] == {"lr": 0.5}


def test_what_torch_save_cannot_write_fails_the_save_call_by_key(tmp_path):
    io = UnickptCheckpointIO(allow_pickle=True)
    import pickle

    with pytest.raises(pickle.PicklingError, match=r"'hyper_parameters\.fn' \(torch\.save could not write it"):
        io.save_checkpoint({"global_step": 1, "hyper_parameters": {"lr": 1, "fn": lambda x: x}}, tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match=r"'state_dict\.w': a sparse_coo tensor; unickpt saves dense"):
        io.save_checkpoint({"global_step": 1, "state_dict": {"w": torch.eye(2).to_sparse()}}, tmp_path / "b.ckpt")
    io.teardown()
    assert os.listdir(tmp_path) == []  # nothing written, no placeholder left
