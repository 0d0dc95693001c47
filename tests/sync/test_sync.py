"""Live weight sync (unickpt.sync) between two real jobs: a training job and an inference job, each with its
own gloo world, joined only by a rendezvous address."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import sync_workers as w  # noqa: E402
from sync_jobs import free_port, run_jobs  # noqa: E402


def _addr() -> str:
    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize("tp", [False, True], ids=["whole-model", "tensor-parallel"])
def test_fsdp2_trainer_to_hf_model_bitwise_each_version(tmp_path, tp):
    """An FSDP2 trainer (2 ranks, fp32, published as bf16) -> a 2-rank bf16 Llama job, whole on each rank or
    tensor parallel (DTensor): after each of 3 training steps, the inference model's parameters and its
    logits on a fixed batch equal, bitwise, those of a model loaded from the trainer's gathered full state;
    an inference thread sampling under the subscriber's lock only ever sees whole versions."""
    addr = _addr()
    res = run_jobs({"train": (w.fsdp2_trainer, 2, (addr, str(tmp_path), 3, False)),
                    "infer": (w.hf_subscriber, 2, (addr, str(tmp_path), 3, tp, not tp))})
    for rank, out in enumerate(res["infer"]):
        assert [r["version"] for r in out["results"]] == [1, 2, 3]
        for r in out["results"]:
            assert r["params_equal"] and r["logits_equal"], (rank, r)
            assert r["report"]["verified"] == r["report"]["full_pairs"] == 2  # one message per trainer rank
        first, later = out["results"][0]["report"], out["results"][1]["report"]
        assert first["plan_seconds"] > 0 and later["plan_seconds"] == 0.0  # planned once, reused
        if not tp:  # the sampler saw the initial weights and whole versions only, never a mix
            allowed = {r["ref_digest"] for r in out["results"]}
            assert set(out["seen"]) - allowed == {d for v, d in out["seen_pairs"] if v is None}
            assert all(v is None or d in allowed for v, d in out["seen_pairs"])
            assert len({v for v, _ in out["seen_pairs"]}) >= 2
    # each trainer rank sends only what it holds: together exactly each receiver's bytes, no gather
    for v in range(3):
        sent = sum(rep[v]["bytes_sent"] for rep in res["train"])
        received = sum(out["results"][v]["report"]["bytes_received"] for out in res["infer"])
        assert sent == received > 0
    if tp:  # a tensor-parallel receiver needs about half of the weights
        whole = sum(p.numel() * 2 for p in w.tiny_llama(0).parameters())
        assert res["infer"][0]["results"][0]["report"]["bytes_received"] < 0.75 * whole


def test_megatron_tp2_trainer_to_hf_llama_with_delta(tmp_path):
    """A Megatron-core TP2 trainer (linear_qkv permuted by query group, [gate; up] as two boxes per rank,
    row- and column-parallel shards) -> a one-process Hugging Face Llama, renamed and split by the
    megatron plugin's rules on the fly: bitwise parameters, logits within 1e-5 of a model loaded from the
    Hugging Face weights; from version 2 on (2 % of the values changed) only deltas are sent."""
    addr = _addr()
    res = run_jobs({"train": (w.megatron_trainer, 2, (addr, 3, True)),
                    "infer": (w.megatron_subscriber, 1, (addr, 3))})
    out = res["infer"][0]
    assert [r["version"] for r in out] == [1, 2, 3]
    for r in out:
        assert r["params_equal"] and r["max_logit_diff"] <= 1e-5, r
    assert out[0]["report"]["delta_pairs"] == 0 and out[0]["report"]["full_pairs"] == 2
    for r in out[1:]:
        rep = r["report"]
        assert rep["delta_pairs"] == 2 and rep["full_pairs"] == 0
        assert rep["bytes_received"] <= 0.10 * rep["full_bytes"], rep
    for rep in res["train"]:
        assert rep[1]["history_bytes"] == rep[1]["full_bytes"] > 0


def test_load_weights_callable_gets_full_hf_tensors(tmp_path):
    """The vLLM / SGLang interface: the subscriber hands every full Hugging Face tensor to
    load_weights(iterable of (name, tensor)) once per version, renamed from a Megatron TP2 trainer."""
    addr = _addr()
    res = run_jobs({"train": (w.megatron_trainer, 2, (addr, 2, False)),
                    "infer": (w.load_weights_subscriber, 1, (addr, 2))})
    out = res["infer"][0]
    n = len(w.tiny_llama(0).state_dict())
    assert [r["version"] for r in out] == [1, 2]
    assert all(r["params_equal"] for r in out)
    assert out[-1]["calls"] == [n, n]


def test_late_subscriber_gets_a_full_version_and_a_corrupted_delta_is_resent(tmp_path):
    """Versions 1-3 are published before any subscriber joins (they reach nobody, at no cost); the
    subscriber that joins gets version 4 in full, then deltas; a byte flipped in version 6's message fails
    the receiver's checksum, which asks for a full resend: the weights are still bitwise right."""
    addr = _addr()
    res = run_jobs({"train": (w.late_trainer, 2, (addr, 7, 6)),
                    "infer": (w.late_subscriber, 1, (addr, 4))})
    for rep in res["train"]:
        assert [r["subscribers"] for r in rep[:3]] == [0, 0, 0] and all(r["bytes_sent"] == 0 for r in rep[:3])
    out = res["infer"][0]
    assert [r["version"] for r in out] == [4, 5, 6, 7]
    assert all(r["equal"] for r in out)
    assert out[0]["report"]["full_pairs"] == 2 and out[0]["report"]["delta_pairs"] == 0
    assert out[1]["report"]["delta_pairs"] == 2
    assert out[2]["report"]["resent_pairs"] == 1 and out[2]["report"]["verified"] == 2
    assert out[3]["report"]["resent_pairs"] == 0 and out[3]["report"]["delta_pairs"] == 2


def test_a_trainer_rank_dying_mid_publish_leaves_the_previous_version(tmp_path):
    """Training rank 1 exits after packing version 2: the subscriber's receive raises SyncError naming the
    version, its model keeps version 1 bitwise, nothing is staged, and the next receive joins again
    (and times out, as no trainer is left) instead of hanging."""
    addr = _addr()
    res = run_jobs({"train": (w.dying_trainer, 2, (addr,)), "infer": (w.dying_subscriber, 1, (addr,))},
                   allow_exit=frozenset({("train", 1)}))
    out = res["infer"][0]
    assert out["first"] == 1 and out["version"] == 1 and out["kept_version_1"]
    assert out["error"] is not None and "version 2" in out["error"] and "keeps version 1" in out["error"]
    assert out["again"].startswith("TimeoutError: no trainer joined weight-sync generation")
    assert "no version is staged" in out["apply"]
    assert "version 2: a training rank is gone" in res["train"][0]["error"]


@pytest.mark.parametrize("strict", [False, True])
def test_an_inference_model_that_does_not_match_names_the_tensor_and_training_goes_on(strict):
    """The inference model's 'w' is [8, 5], the trainer publishes [8, 4]: both sides get the error naming the
    tensor and both shapes; by default the trainer's publish reports it and training goes on (later
    publishes reach nobody, without error); with strict=True the publish raises it."""
    addr = _addr()
    res = run_jobs({"train": (w.mismatch_trainer, 1, (addr, strict)), "infer": (w.mismatch_subscriber, 1, (addr,))})
    msg = "'w': the target's shape is [8, 5], the published tensors give [8, 4]"
    assert msg in res["infer"][0]
    out = res["train"][0]
    if strict:
        assert msg in out["raised"] and "inference rank 0" in out["raised"]
    else:
        assert msg in out["error"]
        assert [(r["subscribers"], r["error"]) for r in out["after"]] == [(0, None), (0, None)]


def test_tied_embeddings_publish_once_and_refuse_to_merge_two_tensors():
    """A trainer with tied embeddings publishes the tensor once; an untied inference model gets it under
    both names (the trainer's alias). An untied trainer cannot feed a tied inference model (two tensors
    into one): both sides get an error naming the two names."""
    addr = _addr()
    res = run_jobs({"train": (w.tied_trainer, 1, (addr, True)), "infer": (w.tied_subscriber, 1, (addr, False))})
    sd, got = res["train"][0]["sd"], res["infer"][0]
    assert got["error"] is None and not got["tied"]
    assert got["sd"] == sd  # bitwise, every name
    assert got["sd"]["lm_head.weight"] == sd["model.embed_tokens.weight"]
    sizes = res["train"][0]["sizes"]
    once = sum(n for k, n in sizes.items() if k != "lm_head.weight")
    assert once <= res["train"][0]["bytes"] <= once + 64 * len(sizes)  # the tied tensor travelled once
    addr = _addr()
    res = run_jobs({"train": (w.tied_trainer, 1, (addr, False)), "infer": (w.tied_subscriber, 1, (addr, True))})
    msg = "'lm_head.weight' is tied to 'model.embed_tokens.weight' in the inference model, but the trainer publishes"
    assert msg in res["infer"][0]["error"] and msg in res["train"][0]["error"]


def test_the_example_runs_an_fsdp2_trainer_and_a_rollout_job():
    """examples/weight_sync.py: the rollout job checks each version against the trainer's full state itself."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "weight_sync.py"), "--steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        for v in (1, 2):
            assert f"[rollout {rank}] version {v}: " in out.stdout and "bitwise equal to the trainer's" in out.stdout
    assert out.stdout.rstrip().endswith("weight sync example: OK")


def test_an_inference_job_that_closes_mid_publish_is_dropped_without_error():
    """Two inference ranks take version 1 and close() while the trainers already publish version 2: the
    trainers see the generation closed, not failed (no error), and publish on to nobody."""
    addr = _addr()
    res = run_jobs({"train": (w.closing_trainer, 2, (addr,)), "infer": (w.closing_subscriber, 2, (addr,))})
    assert res["infer"] == [1, 1]
    for out in res["train"]:
        assert out["first"] == 2 and out["later"] == [(0, None), (0, None)]


def test_inference_ranks_stage_a_version_all_or_none_and_follow_a_trainer_that_leaves():
    """Version 2's messages to inference rank 1 fail their checksum twice: rank 0 got its own messages whole,
    yet neither rank stages version 2 (they agree), both keep version 1 bitwise, the trainers report the
    failure; both join again and get version 3 in full. When the trainer closes, a waiting receive learns it
    from the store at once (SyncError) instead of waiting out its timeout."""
    addr = _addr()
    res = run_jobs({"train": (w.rejected_trainer, 2, (addr,)), "infer": (w.rejected_subscriber, 2, (addr,))})
    for out in res["infer"]:
        assert out["first"] == 1 and out["kept_1"]
        assert "version 2 of generation 1 was not received whole" in out["second"] and "keeps version 1" in out["second"]
        assert out["third"] == (3, 2, 0, True)
        assert "the trainer left weight-sync generation 2" in out["after_close"] and out["after_close_s"] < 10
    for reports in res["train"]:
        assert reports[1]["error"] is None and reports[3]["error"] is None and reports[3]["generation"] == 2
        assert "version 2" in reports[2]["error"]
