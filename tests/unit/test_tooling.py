"""Checkpoint tooling: export to Hugging Face's layout, import from other formats, diff, rm/prune,
the per-save/load log line, CLI errors."""
from __future__ import annotations

import json
import logging
import os
import re
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tooling_workers as w
import unickpt
from unickpt.tools.reader import CheckpointReader
from unickpt.tools.cli import main
from unickpt.errors import UnickptError, UnsafeObjectError
from unickpt.tools.export import SAFETENSORS_DTYPES, export_checkpoint, parse_size
from unickpt.tools.importers import detect_source, import_checkpoint, load_safetensors


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                      b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, pool):
    """A checkpoint saved by 2 ranks: row boxes, column boxes, flat ranges, a replicated tensor."""
    path = str(tmp_path_factory.mktemp("sharded") / "ckpt")
    pool(2).run(w.save_sharded, path)
    return path


# -- reading and export ------------------------------------------------------------------------------
def test_reader_assembles_every_sharding_bitwise(sharded):
    reader = CheckpointReader(sharded)
    chunks = {k: len(reader.tensor_meta(k).chunks) for k in reader.keys()}
    assert chunks == {"model.rows": 2, "model.cols": 2, "model.flat": 2, "model.bias": 1, "optim.m": 1}
    for fqn, want in w.full_tensors().items():
        assert _bits_equal(reader.read(fqn), want), fqn
    assert reader.decoded_objects() == {"step": 12}


def test_export_safetensors_sharded_index_reads_back_identical(sharded, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", sharded, str(out), "--keys", "model", "--max-shard-size", "150B", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    want = {k.removeprefix("model."): v for k, v in w.full_tensors().items() if k.startswith("model.")}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(want) and res["index"] == "model.safetensors.index.json"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values()) == 374
    files = sorted(os.listdir(out))
    assert files == ["model-0000%d-of-00004.safetensors" % i for i in range(1, 5)] + ["model.safetensors.index.json"]
    # transformers-style reading: index -> shard -> tensor, with the safetensors library
    for name, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert _bits_equal(f.get_tensor(name), want[name]), name
    got = {}
    for file in files[:-1]:
        part = load_file(str(out / file))
        assert all(index["weight_map"][k] == file for k in part)
        got.update(part)
    assert got.keys() == want.keys()


def test_export_loads_into_a_module_with_huggingface_hub(tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 20))
    unickpt.save(tmp_path / "c", {"model": model, "optim": {"m": torch.zeros(2)}})
    res = export_checkpoint(str(tmp_path / "c"), str(tmp_path / "hf"), keys="model.", max_shard_size="4KB")
    assert len(res.files) == 3 and res.index == "model.safetensors.index.json"
    fresh = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 20))
    result = hub.load_torch_model(fresh, str(tmp_path / "hf"), strict=True)  # reads the index, then each shard
    assert not result.missing_keys and not result.unexpected_keys
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert _bits_equal(a, b), k


def test_export_single_file_dtype_cast_and_torch_format(sharded, tmp_path):
    res = export_checkpoint(sharded, str(tmp_path / "bf16"), dtype="bf16")
    assert res.files == ["model.safetensors"] and res.index is None
    assert sorted(os.listdir(tmp_path / "bf16")) == ["model.safetensors"]
    got = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for fqn, t in w.full_tensors().items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t  # ints are never cast
        assert _bits_equal(got[fqn], want), fqn
    res = export_checkpoint(sharded, str(tmp_path / "pt"), format="torch", keys="optim", max_shard_size=1)
    assert res.files == ["pytorch_model.bin"] and res.weight_map == {"m": "pytorch_model.bin"}
    assert _bits_equal(torch.load(tmp_path / "pt" / "pytorch_model.bin", weights_only=True)["m"], torch.ones(3))
    res = export_checkpoint(sharded, str(tmp_path / "pt2"), format="torch", max_shard_size="100B")
    index = json.loads((tmp_path / "pt2" / "pytorch_model.bin.index.json").read_text())
    merged = {}
    for file in sorted(set(index["weight_map"].values())):
        merged.update(torch.load(tmp_path / "pt2" / file, weights_only=True))
    assert merged.keys() == w.full_tensors().keys()
    assert all(_bits_equal(merged[k], v) for k, v in w.full_tensors().items())


def test_export_refuses_bad_input(sharded, tmp_path):
    with pytest.raises(UnickptError, match="no tensor fqn starts with 'encoder'; top-level keys are: model, optim"):
        export_checkpoint(sharded, str(tmp_path / "x"), keys="encoder")
    export_checkpoint(sharded, str(tmp_path / "y"))
    with pytest.raises(UnickptError, match=r"model.safetensors already exists; export into an empty directory"):
        export_checkpoint(sharded, str(tmp_path / "y"))
    with pytest.raises(ValueError, match="max shard size '5 parsecs' is not a size"):
        export_checkpoint(sharded, str(tmp_path / "z"), max_shard_size="5 parsecs")
    with pytest.raises(ValueError, match="dtype 'int4' is not one of"):
        export_checkpoint(sharded, str(tmp_path / "z"), dtype="int4")
    assert (parse_size("5GB"), parse_size("2GiB"), parse_size("1.5MB"), parse_size(7)) == (5 * 10**9, 2 << 30, 1_500_000, 7)
    unickpt.save(tmp_path / "c64", {"z": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(UnickptError, match=r"'z': dtype torch.complex128 cannot be stored in safetensors"):
        export_checkpoint(str(tmp_path / "c64"), str(tmp_path / "z"))


def _every_safetensors_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    base = torch.randn(3, 5, generator=g) * 4
    out = {f"t.{dt}".replace("torch.", ""): (base.to(dt) if dt.is_floating_point or dt.is_complex
                                             else (base.abs() * 3).to(dt)) for dt in SAFETENSORS_DTYPES}
    out["t.scalar"] = torch.tensor(2.5)
    out["t.empty"] = torch.zeros(0, 4, dtype=torch.float16)
    return out


def test_safetensors_writer_and_reader_agree_with_the_library_for_every_dtype(tmp_path):
    tensors = _every_safetensors_dtype()
    unickpt.save(tmp_path / "c", tensors)
    export_checkpoint(str(tmp_path / "c"), str(tmp_path / "hf"), max_shard_size="200B")  # several shards
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    got = {}
    for file in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(tmp_path / "hf" / file)))  # the reference reader
    assert got.keys() == tensors.keys() and all(_bits_equal(got[k], v) for k, v in tensors.items())
    save_file(tensors, str(tmp_path / "ref.safetensors"))  # the reference writer
    mine = load_safetensors(str(tmp_path / "ref.safetensors"))
    assert mine.keys() == tensors.keys() and all(_bits_equal(mine[k], v) for k, v in tensors.items())
    (tmp_path / "bad.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(UnickptError, match=r"bad.safetensors: not a safetensors file \(header length 1000000"):
        load_safetensors(str(tmp_path / "bad.safetensors"))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}).encode()
    (tmp_path / "short.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(12))
    with pytest.raises(UnickptError, match=r"tensor 'w' \(torch.float32, shape \[4\]\) has data_offsets \[0, 12\]"):
        load_safetensors(str(tmp_path / "short.safetensors"))


# -- import ------------------------------------------------------------------------------------------
def _source_state() -> dict:
    torch.manual_seed(3)
    return {"layer.weight": torch.randn(8, 4), "layer.bias": torch.randn(8).to(torch.bfloat16),
            "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)}


def _assert_imported(path, want: dict, prefix: str = "") -> None:
    reader = CheckpointReader(str(path))
    assert reader.keys() == sorted(prefix + k for k in want)
    for k, v in want.items():
        assert _bits_equal(reader.read(prefix + k), v), k


def test_import_safetensors_file_and_hf_folders(tmp_path, capsys):
    sd = _source_state()
    save_file(sd, str(tmp_path / "w.safetensors"))
    assert main(["import", str(tmp_path / "w.safetensors"), str(tmp_path / "u1"), "--prefix", "model", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "safetensors"
    _assert_imported(tmp_path / "u1", sd, "model.")
    # an HF folder written by export (sharded, with index), and one with pytorch_model.bin shards
    export_checkpoint(str(tmp_path / "u1"), str(tmp_path / "hf"), keys="model", max_shard_size="60B")
    assert len(os.listdir(tmp_path / "hf")) == 4 and detect_source(str(tmp_path / "hf")) == "hf"
    import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "u2"))
    _assert_imported(tmp_path / "u2", sd)
    export_checkpoint(str(tmp_path / "u1"), str(tmp_path / "hfbin"), keys="model", max_shard_size="60B", format="torch")
    res = import_checkpoint(str(tmp_path / "hfbin"), str(tmp_path / "u3"), step=40)
    assert (res.source, res.tensors, res.tensor_bytes) == ("hf", 3, 8 * 4 * 4 + 8 * 2 + 6 * 8)
    _assert_imported(tmp_path / "u3", sd)
    assert CheckpointReader(str(tmp_path / "u3")).meta.step == 40
    # into a run's root: the step comes from the name, and `latest` follows
    root = tmp_path / "run"
    unickpt.Checkpointer(root, async_save=False).save(5, {"w": torch.ones(1)})
    import_checkpoint(str(tmp_path / "hf"), str(root / "step_7"))
    assert CheckpointReader(str(root / "step_7")).meta.step == 7 and (root / "latest").read_text() == "step_7"
    import_checkpoint(str(tmp_path / "hf"), str(root / "step_3"))
    assert (root / "latest").read_text() == "step_7"


def test_import_torch_file_keeps_structure_and_plain_values(tmp_path):
    sd = _source_state()
    torch.save({"model": sd, "epoch": 3, "names": ["a", "b"]}, tmp_path / "ckpt.pt")
    import_checkpoint(str(tmp_path / "ckpt.pt"), str(tmp_path / "u"))
    _assert_imported(tmp_path / "u", sd, "model.")
    assert CheckpointReader(str(tmp_path / "u")).decoded_objects() == {"epoch": 3, "names": ["a", "b"]}
    target = {"model": {k: torch.empty_like(v) for k, v in sd.items()}, "epoch": 0, "names": []}
    unickpt.load(tmp_path / "u", target)
    assert target["epoch"] == 3 and all(_bits_equal(target["model"][k], v) for k, v in sd.items())


class _Custom:  # pickled: torch.load(weights_only=True) refuses it
    def __eq__(self, other):
        return isinstance(other, _Custom)


def test_import_torch_file_with_objects_needs_allow_pickle(tmp_path):
    torch.save({"w": torch.ones(2), "obj": _Custom()}, tmp_path / "c.pt")
    with pytest.raises(UnsafeObjectError, match=r"c.pt: holds objects beyond tensors and containers .*--allow-pickle"):
        import_checkpoint(str(tmp_path / "c.pt"), str(tmp_path / "u"))
    assert not (tmp_path / "u").exists()
    import_checkpoint(str(tmp_path / "c.pt"), str(tmp_path / "u"), allow_pickle=True)
    reader = CheckpointReader(str(tmp_path / "u"))
    assert reader.decoded_objects(allow_pickle=True) == {"obj": _Custom()}
    with pytest.raises(UnsafeObjectError):
        reader.decoded_objects()


def test_import_dcp_directory_needs_allow_pickle_and_equals_source(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    sd = _source_state()
    dcp.save({"model": sd, "step": 5}, checkpoint_id=str(tmp_path / "dcp"))
    assert main(["import", str(tmp_path / "dcp"), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reading a dcp checkpoint runs the unpickler" in err and "--allow-pickle" in err
    assert main(["-q", "import", str(tmp_path / "dcp"), str(tmp_path / "u"), "--allow-pickle"]) == 0
    assert "imported dcp checkpoint" in capsys.readouterr().out
    _assert_imported(tmp_path / "u", sd, "model.")
    assert CheckpointReader(str(tmp_path / "u")).decoded_objects() == {"step": 5}


def test_import_detects_what_it_cannot_read(tmp_path, capsys):
    os.makedirs(tmp_path / "empty")
    assert main(["import", str(tmp_path / "empty"), str(tmp_path / "u")]) == 2
    assert "not a checkpoint this tool can import" in capsys.readouterr().err
    unickpt.save(tmp_path / "already", {"w": torch.ones(1)})
    with pytest.raises(UnickptError, match="is already a unickpt checkpoint"):
        detect_source(str(tmp_path / "already"))
    assert main(["import", str(tmp_path / "missing.pt"), str(tmp_path / "u")]) == 2
    assert capsys.readouterr().err == f"unickpt import: {str(tmp_path / 'missing.pt')!r} does not exist\n"


# -- diff --------------------------------------------------------------------------------------------
def test_diff_finds_a_single_changed_element(tmp_path, capsys):
    w0 = torch.randn(64, 33)
    unickpt.save(tmp_path / "a", {"model": {"w": w0, "b": torch.zeros(5)}})
    w1 = w0.clone()
    w1[17, 5] = torch.nextafter(w1[17, 5], torch.tensor(float("inf")))  # one ulp, one element
    unickpt.save(tmp_path / "b", {"model": {"w": w1, "b": torch.zeros(5)}})
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    (d,) = json.loads(capsys.readouterr().out)
    assert (d["key"], d["kind"], d["elements_differ"], d["first_index"]) == ("model.w", "values", 1, [17, 5])
    assert d["max_abs_diff"] == pytest.approx(abs(w1[17, 5].item() - w0[17, 5].item()), rel=0) and d["max_abs_diff"] > 0
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "1 of 2112 elements differ, first at [17, 5]" in capsys.readouterr().out
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "nope")]) == 2
    assert "no committed checkpoint at" in capsys.readouterr().err


def test_diff_sharded_against_its_import_of_the_export_is_identical(sharded, tmp_path, capsys):
    export_checkpoint(sharded, str(tmp_path / "hf"), max_shard_size="200B")
    import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "back"))
    assert main(["diff", sharded, str(tmp_path / "back"), "--json"]) == 1
    assert [(d["key"], d["kind"]) for d in json.loads(capsys.readouterr().out)] == [("step", "missing_in_b")]


def test_diff_checks_a_conversion_against_the_source_format(tmp_path, capsys):
    sd = _source_state()
    torch.save({"model": sd, "epoch": 3}, tmp_path / "src.pt")
    import_checkpoint(str(tmp_path / "src.pt"), str(tmp_path / "u"))
    assert main(["diff", str(tmp_path / "src.pt"), str(tmp_path / "u")]) == 0
    assert "identical" in capsys.readouterr().out
    changed = {k: v.clone() for k, v in sd.items()}
    changed["ids"][1, 2] = 99
    save_file(changed, str(tmp_path / "changed.safetensors"))
    assert main(["diff", str(tmp_path / "u"), str(tmp_path / "changed.safetensors"), "--json"]) == 1
    got = {(d["key"], d["kind"]): d for d in json.loads(capsys.readouterr().out)}
    assert set(got) == {(f"model.{k}", "missing_in_b") for k in sd} | {(k, "missing_in_a") for k in sd} | \
        {("epoch", "missing_in_b")}
    unickpt.save(tmp_path / "nested", {"model": changed, "epoch": 3})
    assert main(["diff", str(tmp_path / "src.pt"), str(tmp_path / "nested"), "--json"]) == 1
    (d,) = json.loads(capsys.readouterr().out)
    assert (d["key"], d["max_abs_diff"], d["elements_differ"], d["first_index"]) == ("model.ids", 94.0, 1, [1, 2])


# -- rm / prune --------------------------------------------------------------------------------------
def _run_dir(tmp_path, steps):
    root = tmp_path / "run"
    ckpt = unickpt.Checkpointer(root, async_save=False)
    for s in steps:
        ckpt.save(s, {"w": torch.full((4,), float(s))})
    return root


def test_rm_respects_the_commit_rules(tmp_path, capsys):
    root = _run_dir(tmp_path, [1, 2, 3])
    os.makedirs(root / "step_9" / "data")  # a crashed save (no writer record: dead)
    assert main(["rm", str(root / "step_3")]) == 2
    assert "newest committed checkpoint" in capsys.readouterr().err and (root / "step_3" / "metadata.json").exists()
    assert main(["rm", str(root / "step_1"), str(root / "step_9"), "--json"]) == 0
    assert [(r["step"], r["committed"]) for r in json.loads(capsys.readouterr().out)] == [(1, True), (9, False)]
    assert sorted(os.listdir(root)) == ["latest", "step_2", "step_3"]
    (root / "step_2" / "notes.txt").write_text("mine")
    assert main(["rm", str(root / "step_2")]) == 2
    assert "holds 'notes.txt', which no unickpt save writes" in capsys.readouterr().err
    assert main(["rm", str(root / "step_2"), str(root / "step_1"), "--dry-run"]) == 2  # each path on its own
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 2 and "'notes.txt'" in err and f"{str(root / 'step_1')!r} is not a directory" in err
    assert main(["rm", "--force", str(root / "step_3")]) == 0
    assert (root / "latest").read_text() == "step_2"  # rewritten to the newest remaining commit
    # a save in progress (its writer, this process, is alive) is never removed
    os.makedirs(root / "step_10" / "data")
    from unickpt.lifecycle.directory import writer_record
    (root / "step_10" / ".unickpt-writer").write_bytes(writer_record())
    assert main(["rm", str(root / "step_10")]) == 2
    assert "being written by a live process" in capsys.readouterr().err


def test_prune_keeps_the_newest_and_drops_crashed_saves(tmp_path, capsys):
    root = _run_dir(tmp_path, [1, 2, 3, 4])
    os.makedirs(root / "step_0" / "data")
    os.makedirs(root / "step_5" / "data")  # newer than every commit: maybe in flight, kept
    os.makedirs(root / "step_2" / "extra")  # foreign content: kept
    assert main(["prune", str(root), "--keep-last", "1", "--dry-run"]) == 0
    assert sorted(os.listdir(root)) == ["latest", "step_0", "step_1", "step_2", "step_3", "step_4", "step_5"]
    assert re.findall(r"would remove \S+/(step_\d+)", capsys.readouterr().out) == ["step_0", "step_1", "step_3"]
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert sorted(os.listdir(root)) == ["latest", "step_2", "step_4", "step_5"]
    assert (root / "latest").read_text() == "step_4"
    target = {"w": torch.zeros(4)}
    assert unickpt.Checkpointer(root).load(target) == 4 and torch.equal(target["w"], torch.full((4,), 4.0))


def test_prune_ignores_a_step_dir_with_leading_zeros(tmp_path, capsys):
    """Regression: ``step_01`` was read as step 1; as an incomplete "step 1" older than the newest
    commit, prune removed ``step_1`` (committed and within --keep-last) in its name."""
    from unickpt.checkpointer import list_checkpoints

    root = _run_dir(tmp_path, [1, 5])
    os.makedirs(root / "step_01" / "data")  # not a name the Checkpointer writes
    assert list_checkpoints(str(root)) == [(1, True), (5, True)]
    assert main(["prune", str(root), "--keep-last", "2"]) == 0
    assert sorted(os.listdir(root)) == ["latest", "step_01", "step_1", "step_5"]
    target = {"w": torch.zeros(4)}
    unickpt.load(root / "step_1", target)
    assert torch.equal(target["w"], torch.full((4,), 1.0))


# -- observability, CLI errors -----------------------------------------------------------------------
def test_one_log_line_per_save_and_load_with_the_stats(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger="unickpt"):  # routine records are DEBUG (issue #34)
        handle = unickpt.save(tmp_path / "c", {"w": torch.zeros(1000)}, step=3)
        stats = unickpt.load(tmp_path / "c", {"w": torch.empty(1000)})
    lines = [r for r in caplog.records if r.name == "unickpt" and r.levelno == logging.DEBUG]
    assert [r.unickpt_event for r in lines] == ["save", "load"]
    save_msg, load_msg = (r.getMessage() for r in lines)
    assert re.fullmatch(r"unickpt: committed \S+/c \(step 3\): 0\.0 MB in [\d.]+ s \([\d.]+ GB/s\), stall [\d.]+ s, 1 rank\(s\)",
                        save_msg), save_msg
    assert "loaded" in load_msg and "(step 3)" in load_msg and "GB/s" in load_msg
    assert lines[0].unickpt_stats is handle.stats and lines[1].unickpt_stats is stats
    assert handle.stats.bytes_written >= 4000 and stats.bytes_read == 4000


def test_cli_errors_on_bad_paths_are_one_line_exit_2(tmp_path, capsys):
    for argv in (["inspect", str(tmp_path / "no")], ["verify", str(tmp_path / "no")], ["ls", str(tmp_path / "no")],
                 ["export", str(tmp_path / "no"), str(tmp_path / "o")], ["rm", str(tmp_path / "no")],
                 ["prune", str(tmp_path / "no"), "--keep-last", "2"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"unickpt {argv[0]}: ") and err.count("\n") == 1 and "Traceback" not in err, err


# -- docs ------------------------------------------------------------------------------------------
def test_the_reader_in_docs_format_md_reads_checkpoints_without_unickpt(sharded, tmp_path):
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "format.md")).read()
    (code,) = re.findall(r"A complete reader.*?```python\n(.*?)```", text, re.S)
    ns: dict = {}
    exec(compile(code, "docs/format.md", "exec"), ns)  # the documented reader, as printed
    for fqn, want in w.full_tensors().items():
        got = torch.from_numpy(ns["read_tensor"](sharded, fqn).copy())
        if want.dtype == torch.bfloat16:
            got = got.view(torch.bfloat16)  # raw bits, as documented
        assert _bits_equal(got, want), fqn
    big = torch.randn(700, 1000)  # 2.8 MB: one chunk with 3 checksum blocks
    unickpt.save(tmp_path / "big", {"x": big, "tied": big})
    meta = json.loads((tmp_path / "big" / "metadata.json").read_text())
    assert len(meta["tensors"]["x"]["chunks"][0]["block_checksums"]) == 3 and meta["aliases"] == {"tied": "x"}
    assert _bits_equal(torch.from_numpy(ns["read_tensor"](str(tmp_path / "big"), "tied")), big)
    raw = bytearray((tmp_path / "big" / "data" / "0_0.bin").read_bytes())
    raw[2 << 20] ^= 1
    (tmp_path / "big" / "data" / "0_0.bin").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum mismatch"):
        ns["read_tensor"](str(tmp_path / "big"), "x")


def test_progress_bar_only_on_a_terminal(sharded, tmp_path, capsys, monkeypatch):
    assert main(["verify", sharded]) == 0
    assert capsys.readouterr().err == ""  # not a terminal: quiet
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["export", sharded, str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "export" in err and "100%" in err and "386/386" in err
    assert main(["export", sharded, str(tmp_path / "o2"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


_EXPORT_PEAK = """
import re, sys
from unickpt.tools.export import export_checkpoint
# VmHWM: this process's peak RSS (ru_maxrss would include the parent's, inherited across fork)
kb = lambda field: int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
before = kb("VmRSS")
assert kb("VmHWM") - before < 64 << 10  # the imports did not peak above what the export may use
export_checkpoint(sys.argv[1], sys.argv[2], keys="model")
print((kb("VmHWM") - before) << 10)  # the export's peak growth, bytes
"""


def test_export_holds_one_tensor_at_a_time(tmp_path):
    import subprocess

    layers = {f"layer{i}": torch.full((4 << 20,), float(i)) for i in range(8)}  # 8 tensors of 16 MB
    unickpt.save(tmp_path / "c", {"model": layers})
    # glibc's dynamic mmap threshold rises after the first 16 MB block is freed, and it then keeps
    # freed blocks in its heap: the peak was 1-4 blocks (18-66 MB), varying with the heap's layout
    # (which imports and code changes shift). A fixed threshold returns every freed block to the
    # system, so the peak is what the export holds: measured 18 MB on every run
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    res = subprocess.run([sys.executable, "-c", _EXPORT_PEAK, str(tmp_path / "c"), str(tmp_path / "o")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    growth = int(res.stdout.split()[-1])
    # one tensor in memory (16 MB), far from the whole model (--format torch, which holds a shard,
    # measures ~137 MB here)
    assert growth < 32 << 20, f"export grew the process by {growth >> 20} MB for a 128 MB model of 16 MB tensors"
    got = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert got.keys() == layers.keys() and all(torch.equal(got[k], v) for k, v in layers.items())


# -- regressions found by breaking the tools as a new user -------------------------------------------
def _corrupt(path, fqn: str) -> None:
    meta = json.loads((path / "metadata.json").read_text())
    chunk = meta["tensors"][fqn]["chunks"][0]
    data = path / chunk["file"]
    raw = bytearray(data.read_bytes())
    raw[chunk["byte_offset"]] ^= 1
    data.write_bytes(bytes(raw))


def test_a_failed_export_leaves_no_partial_model_and_names_the_tensor(tmp_path, capsys):
    unickpt.save(tmp_path / "c", {"a": torch.ones(4), "b": torch.ones(4), "c": torch.arange(4.0), "d": torch.ones(4)})
    _corrupt(tmp_path / "c", "c")
    for fmt in ("safetensors", "torch"):  # 4 shards of one tensor: a and b are written before c fails
        out = tmp_path / f"o_{fmt}"
        assert main(["export", str(tmp_path / "c"), str(out), "--format", fmt, "--max-shard-size", "16B"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("unickpt export: tensor 'c': ") and "checksum" in err and err.count("\n") == 1, err
        assert not out.exists()  # no shards without their index (a rerun would refuse "already exists")
    os.makedirs(tmp_path / "mine")
    (tmp_path / "mine" / "README").write_text("keep")
    with pytest.raises(UnickptError, match="tensor 'c': "):
        export_checkpoint(str(tmp_path / "c"), str(tmp_path / "mine"), max_shard_size=16)
    assert os.listdir(tmp_path / "mine") == ["README"]  # the user's directory and files stay


def test_export_refuses_overflowing_casts_empty_exports_and_name_clashes(tmp_path):
    big = torch.tensor([1.0, 7e4, float("inf"), float("nan")])  # inf and nan stay themselves: fine
    f8 = torch.tensor([0.5, -448.0]).to(torch.float8_e4m3fn)  # torch has no isfinite for float8
    unickpt.save(tmp_path / "c", {"model": {"w": big, "ok": torch.tensor([1.0, float("-inf")]), "f8": f8}})
    with pytest.raises(UnickptError, match=r"^'model.w': 1 value\(s\) overflow torch.float16 \(max 65504\), "
                                           r"e.g. 70000.0 at \[1\]; export with a wider --dtype or none$"):
        export_checkpoint(str(tmp_path / "c"), str(tmp_path / "fp16"), dtype="fp16")
    assert not (tmp_path / "fp16").exists()
    export_checkpoint(str(tmp_path / "c"), str(tmp_path / "bf16"), dtype="bf16")  # fits bfloat16's range
    got = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert _bits_equal(got["model.w"], big.to(torch.bfloat16)) and _bits_equal(got["model.f8"], f8.to(torch.bfloat16))
    unickpt.save(tmp_path / "fp4", {"q": torch.tensor([1, 2], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)})
    with pytest.raises(UnickptError, match=r"'q': torch cannot cast torch.float4_e2m1fn_x2 to torch.bfloat16"):
        export_checkpoint(str(tmp_path / "fp4"), str(tmp_path / "q4"), format="torch", dtype="bf16")
    assert not (tmp_path / "q4").exists()
    unickpt.save(tmp_path / "plain", {"step": 3, "lr": 0.1})
    with pytest.raises(UnickptError, match="holds no tensors .only plain values.; there is nothing to export"):
        export_checkpoint(str(tmp_path / "plain"), str(tmp_path / "p"))
    assert not (tmp_path / "p").exists()
    unickpt.save(tmp_path / "clash", {"model": torch.ones(1), "model.model": torch.zeros(1)})
    with pytest.raises(UnickptError, match="'model' and 'model.model' would both be exported as 'model'"):
        export_checkpoint(str(tmp_path / "clash"), str(tmp_path / "q"), keys="model")
    assert export_checkpoint(str(tmp_path / "clash"), str(tmp_path / "q"), keys="model", strip_prefix=False).weight_map \
        == {"model": "model.safetensors", "model.model": "model.safetensors"}
    with pytest.raises(UnickptError, match="is inside the checkpoint"):  # never write into a committed checkpoint
        export_checkpoint(str(tmp_path / "c"), str(tmp_path / "c" / "hf"))
    assert sorted(os.listdir(tmp_path / "c")) == [".unickpt-writer", "data", "metadata.json"]


def test_diff_max_abs_diff_is_exact_for_integers_and_ignores_equal_nans(tmp_path, capsys):
    i64 = torch.tensor([2**62, 5])
    u64 = torch.tensor([0, 1], dtype=torch.int64).to(torch.uint64)
    u64_b = u64.clone()
    u64_b.view(torch.int64)[1] = -1  # 2**64 - 1
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    fp4 = torch.tensor([1, 2], dtype=torch.uint8)  # no .item() in torch: shown as raw bits
    unickpt.save(tmp_path / "a", {"i": i64, "u": u64, "x": nan, "q": fp4.view(torch.float4_e2m1fn_x2)})
    unickpt.save(tmp_path / "b", {"i": i64 + torch.tensor([1, 0]), "u": u64_b, "x": nan + torch.tensor([0.0, 1e-12]),
                                  "q": (fp4 + 1).view(torch.float4_e2m1fn_x2)})
    # float64 would round 2**62 + 1 to 2**62 and call the difference 0, hiding it from --atol 0.5
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "0.5", "--json"]) == 1
    got = {d["key"]: d for d in json.loads(capsys.readouterr().out)}
    assert set(got) == {"i", "u", "q"}  # x: its NaN is bitwise equal on both sides, 1e-12 <= 0.5
    assert got["q"]["detail"] == "max |a-b| = nan, 2 of 2 elements differ, first at [0]: 0x01 vs 0x02"
    assert (got["i"]["max_abs_diff"], got["i"]["first_index"]) == (1, [0])
    assert got["u"]["max_abs_diff"] == 2**64 - 2
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "max |a-b| = 1, 1 of 2 elements differ, first at [0]: 4611686018427387904 vs 4611686018427387905" \
        in capsys.readouterr().out


def test_import_errors_are_one_line_exit_2_and_never_ask_to_unpickle_a_non_torch_file(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello, not a checkpoint\n")
    torch.save({"w": torch.ones(300)}, tmp_path / "w.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "w.pt").read_bytes()[:200])
    torch.save({"x.y": torch.ones(1), "x": {"y": torch.zeros(1)}}, tmp_path / "clash.pt")  # both are fqn x.y
    cases = [(["notes.txt"], "notes.txt: not a torch.save file (it starts with b'hell', not a zip archive or a pickle)"),
             (["notes.txt", "--allow-pickle"], "notes.txt: not a torch.save file"),  # was a traceback, exit 1
             (["cut.pt"], "cut.pt: cannot be read as a torch.save file (RuntimeError: PytorchStreamReader failed"),
             (["clash.pt"], "failed on rank(s) [0]; nothing was committed; rank 0: ValueError: two entries of the "
                            "state map to the fqn 'x.y': ('x.y',) and ('x', 'y'); rename one")]
    for i, (argv, want) in enumerate(cases):
        src, *opts = argv
        assert main(["import", str(tmp_path / src), str(tmp_path / f"u{i}"), *opts]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("unickpt import: ") and want in err and err.count("\n") == 1, err
        assert "Traceback" not in err and "--allow-pickle" not in err, err
    assert main(["diff", str(tmp_path / "notes.txt"), str(tmp_path / "w.pt")]) == 2
    assert "not a torch.save file" in capsys.readouterr().err


def test_rm_applies_the_commit_rules_to_relative_paths_and_symlinks(tmp_path, capsys, monkeypatch):
    root = _run_dir(tmp_path, [1, 2])
    os.symlink(root / "step_2", tmp_path / "link")
    monkeypatch.chdir(root)
    for path in ("step_2", "step_2/.", str(tmp_path / "link")):  # all three are the newest commit
        assert main(["rm", path]) == 2, path
        assert "is the newest committed checkpoint of" in capsys.readouterr().err
    assert (root / "step_2" / "metadata.json").exists() and (root / "latest").read_text() == "step_2"
    assert main(["rm", str(tmp_path / "link"), "--force"]) == 0  # the real directory goes, latest follows
    assert sorted(os.listdir(root)) == ["latest", "step_1"] and (root / "latest").read_text() == "step_1"
    assert main(["rm", "step_1", "--force"]) == 0
    assert os.listdir(root) == []  # no commit left: no latest


def test_prune_says_why_it_kept_a_directory(tmp_path, capsys):
    root = _run_dir(tmp_path, [1, 2, 3])
    (root / "step_1" / "notes.txt").write_text("mine")
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    out, err = capsys.readouterr()
    assert re.findall(r"removed \S+/(step_\d+)", out) == ["step_2"]
    assert err == f"unickpt prune: kept {str(root / 'step_1')!r} holds 'notes.txt', which no unickpt save writes; " \
                  "not removing it\n"


def test_import_into_a_relative_step_dir_updates_latest_and_refuses_a_contradicting_step(tmp_path, monkeypatch, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    os.makedirs(tmp_path / "run")
    monkeypatch.chdir(tmp_path / "run")
    import_checkpoint(str(tmp_path / "w.pt"), "step_5")
    assert (tmp_path / "run" / "latest").read_text() == "step_5"
    assert main(["import", str(tmp_path / "w.pt"), "step_7", "--step", "3"]) == 2
    assert capsys.readouterr().err == "unickpt import: --step 3 contradicts the directory name step_7 of 'step_7', by " \
        "which `ls`, `latest` and Checkpointer.load know it; drop --step or rename the target\n"
    with pytest.raises(UnickptError, match=r"'step_0100': name it step_100; a run's checkpoints are step_<N> without"):
        import_checkpoint(str(tmp_path / "w.pt"), "step_0100")  # latest would name a step_100 that does not exist
    assert sorted(os.listdir(tmp_path / "run")) == ["latest", "step_5"]


def test_concurrent_prunes_both_succeed_and_latest_never_goes_back(tmp_path, monkeypatch):
    import threading

    from unickpt.lifecycle.root import CheckpointRoot, prune_checkpoints

    for trial in range(3):  # two prunes of one root at once (a cron job and a person, say)
        root = tmp_path / f"run{trial}"
        for i in range(1, 21):
            os.makedirs(root / f"step_{i}" / "data")
            for j in range(20):
                (root / f"step_{i}" / "data" / f"0_{j}.bin").write_bytes(b"x")
            (root / f"step_{i}" / "metadata.json").write_text("{}")
        (root / "latest").write_text("step_20")
        errors: list = []

        def prune(root=root):
            try:
                prune_checkpoints(str(root), 1)
            except Exception as e:  # noqa: BLE001 - the test reports it
                errors.append(repr(e))

        threads = [threading.Thread(target=prune) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors and sorted(os.listdir(root)) == ["latest", "step_20"], errors
    # a save commits step_3 (and writes latest) after update_latest listed the root: not undone
    root = _run_dir(tmp_path / "r", [1, 2, 3])
    monkeypatch.setattr(CheckpointRoot, "committed_steps", lambda self: [1, 2])
    CheckpointRoot(str(root)).update_latest()
    assert (root / "latest").read_text() == "step_3"


def test_import_of_a_broken_dcp_directory_is_one_line_exit_2(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "dcp" / "__0_0.distcp").unlink()  # torch raises CheckpointException, a BaseException
    os.makedirs(tmp_path / "junk")
    (tmp_path / "junk" / ".metadata").write_bytes(b"not a pickle")
    cases = [("dcp", "dcp: reading the DCP checkpoint failed: FileNotFoundError: [Errno 2] No such file or directory"),
             ("junk", "junk/.metadata: not readable as DCP metadata (UnpicklingError"),
             ("w.pt", "'w.pt' is not a DCP checkpoint directory: it has no .metadata file")]
    torch.save({"w": torch.ones(1)}, tmp_path / "w.pt")
    for i, (src, want) in enumerate(cases):
        assert main(["import", str(tmp_path / src), str(tmp_path / f"u{i}"), "--source", "dcp", "--allow-pickle"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("unickpt import: ") and want in err.replace(str(tmp_path) + "/", "") \
            and err.count("\n") == 1, err


def test_prune_never_follows_a_symlinked_step_dir_into_another_run(tmp_path, capsys):
    root = _run_dir(tmp_path, [2, 3])
    other = unickpt.Checkpointer(tmp_path / "other", async_save=False)
    other.save(1, {"w": torch.ones(4)})  # the only (newest) checkpoint of another run
    os.symlink(tmp_path / "other" / "step_1", root / "step_1")
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    out, err = capsys.readouterr()
    assert re.findall(r"removed \S+/(step_\d+)", out) == ["step_2"]
    assert err == f"unickpt prune: kept {str(root / 'step_1')!r} is a symbolic link to " \
                  f"{str(tmp_path / 'other' / 'step_1')!r}; not removing it or its target\n"
    assert (tmp_path / "other" / "step_1" / "metadata.json").exists()  # was uncommitted, then rmtree refused
