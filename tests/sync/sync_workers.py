"""Workers of tests/sync/test_sync.py: training and inference jobs joined by ``unickpt.sync``."""
from __future__ import annotations

import os
import threading
import time

import torch

import unickpt
from unickpt.sync import Publisher, Subscriber

HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=HEADS, num_key_value_heads=GROUPS, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).to(dtype).eval()


BATCH = torch.arange(24).reshape(2, 12) % 128


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(BATCH).logits
    return out.to_local() if hasattr(out, "to_local") else out


def publish_when_joined(pub: Publisher, version: int, wait_s: float = 60.0):
    """Publish ``version`` once a subscriber has joined (a publish with none sends nothing)."""
    deadline = time.time() + wait_s
    while True:
        rep = pub.publish(version)
        if rep.subscribers or rep.error or time.time() > deadline:
            return rep
        time.sleep(0.1)


def digest_params(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- FSDP2 trainer -> Hugging Face model (whole on each rank, or tensor parallel) -----------------------------
def fsdp2_trainer(rank, world, addr, out, versions, delta):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama(0)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pub = Publisher(model, addr, dtype=torch.bfloat16, delta=delta)
    reports = []
    for v in range(1, versions + 1):
        model.train()
        loss = model(BATCH, labels=BATCH).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:  # the reference: the trainer's gathered full state, in the inference dtype
            torch.save({k: t.to(torch.bfloat16) for k, t in full.items()}, os.path.join(out, f"ref_{v}.pt"))
        torch.distributed.barrier()
        reports.append(vars(publish_when_joined(pub, v)).copy())
    pub.close()
    return reports


def _reference(out, version, tp_mesh=None):
    ref = tiny_llama(1, torch.bfloat16)
    ref.load_state_dict(torch.load(os.path.join(out, f"ref_{version}.pt")))
    if tp_mesh is not None:
        _parallelize(ref, tp_mesh)
    return ref


def _parallelize(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                     p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                     p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                     p + "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    return model


def hf_subscriber(rank, world, addr, out, versions, tp, sample):
    """An inference job: a bf16 Llama (whole, or tensor parallel over the job's ranks); after each update
    its parameters and logits must equal (bitwise) a model loaded from the trainer's full state."""
    mesh = None
    model = tiny_llama(1, torch.bfloat16)  # other initial weights than the trainer's
    if tp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        _parallelize(model, mesh)
    sub = Subscriber(model, addr)
    seen, stop = [], threading.Event()

    def sampler():  # inference in another thread, under the subscriber's lock
        while not stop.is_set():
            with sub.lock:
                seen.append((sub.version, digest_params(model)))
            time.sleep(0.001)

    thread = threading.Thread(target=sampler) if sample else None
    if thread is not None:
        thread.start()
    results = []
    for _ in range(versions):
        rep = sub.update(timeout_s=120)
        ref = _reference(out, rep.version, mesh)
        same_params = all(torch.equal(a.to_local() if hasattr(a, "to_local") else a,
                                      b.to_local() if hasattr(b, "to_local") else b)
                          for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
        results.append({"version": rep.version, "params_equal": same_params,
                        "logits_equal": torch.equal(logits(model), logits(ref)), "report": vars(rep).copy(),
                        "ref_digest": digest_params(ref)})
    stop.set()
    if thread is not None:
        thread.join()
    sub.close()
    return {"results": results, "seen": sorted({d for _, d in seen}), "seen_pairs": sorted(set(seen), key=str)}


# -- a Megatron TP2 trainer (megatron-core names and shards) -> a Hugging Face Llama ----------------------------
def megatron_full(hf_state: dict) -> dict:
    """Megatron-core names of a Hugging Face Llama state (linear_qkv permuted by query group, [gate; up])."""
    from unickpt import Mapping
    from unickpt.megatron.hf import llama_rules

    resolve = Mapping(llama_rules(HEADS, GROUPS, HEAD_DIM, to="megatron")).resolver(
        lambda n: (tuple(hf_state[n].shape), str(hf_state[n].dtype).removeprefix("torch.")) if n in hf_state else None)
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    for i in range(2):
        m = f"decoder.layers.{i}."
        names += [m + "self_attention.linear_qkv.weight", m + "self_attention.linear_qkv.layer_norm_weight",
                  m + "self_attention.linear_proj.weight", m + "mlp.linear_fc1.weight",
                  m + "mlp.linear_fc1.layer_norm_weight", m + "mlp.linear_fc2.weight"]
    out = {}
    for n in names:
        res = resolve(n)
        t = torch.empty(res.shape, dtype=hf_state[res.pieces[0].source].dtype)
        for p in res.pieces:
            src = hf_state[p.source][tuple(slice(o, o + k) for o, k in zip(p.offsets, p.region.lengths))]
            t[tuple(slice(o, o + k) for o, k in zip(p.region.offsets, p.region.lengths))] = src
        out[n] = t
    return out


def megatron_shards(full: dict, rank: int, tp: int) -> dict:
    """Tensor-parallel rank ``rank``'s shards, as megatron-core holds them (``linear_fc1`` local = [gate_r; up_r])."""
    out = {}
    for n, t in full.items():
        if n.endswith("linear_fc1.weight"):
            f = t.shape[0] // 2
            k = f // tp
            out[n] = [unickpt.Shard(t[rank * k:(rank + 1) * k].clone(), t.shape, offsets=(rank * k, 0)),
                      unickpt.Shard(t[f + rank * k:f + (rank + 1) * k].clone(), t.shape, offsets=(f + rank * k, 0))]
        elif n.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
            k = t.shape[0] // tp
            out[n] = unickpt.Shard(t[rank * k:(rank + 1) * k].clone(), t.shape, offsets=(rank * k, 0))
        elif n.endswith(("linear_proj.weight", "linear_fc2.weight")):
            k = t.shape[1] // tp
            out[n] = unickpt.Shard(t[:, rank * k:(rank + 1) * k].clone(), t.shape, offsets=(0, rank * k))
        else:
            out[n] = t.clone()  # norms: replicated over the tensor-parallel ranks
    return out


def _hf_version(version: int) -> dict:
    """Version ``version`` of the Hugging Face weights: version 1 random, then 2 % of the values changed per version."""
    state = {k: v.clone() for k, v in tiny_llama(0).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for _ in range(2, version + 1):
        for t in state.values():
            mask = torch.rand(t.shape, generator=g) < 0.02
            t[mask] += torch.randn(t.shape, generator=g)[mask]
    return state


def megatron_trainer(rank, world, addr, versions, delta):
    state = {}
    pub = Publisher(lambda: state, addr, delta=delta)
    reports = []
    for v in range(1, versions + 1):
        state.clear()
        state.update(megatron_shards(megatron_full(_hf_version(v)), rank, world))
        reports.append(vars(publish_when_joined(pub, v)).copy())
    pub.close()
    return reports


def megatron_subscriber(rank, world, addr, versions):
    from unickpt import Mapping
    from unickpt.megatron.hf import llama_rules

    model = tiny_llama(1)
    sub = Subscriber(model, addr, mapping=Mapping(llama_rules(HEADS, GROUPS, HEAD_DIM, to="hf")))
    results = []
    for _ in range(versions):
        rep = sub.update(timeout_s=120)
        ref = tiny_llama(2)
        ref.load_state_dict(_hf_version(rep.version))
        diff = (logits(model) - logits(ref)).abs().max().item()
        results.append({"version": rep.version, "max_logit_diff": diff, "report": vars(rep).copy(),
                        "params_equal": all(torch.equal(a, b) for a, b in
                                            zip(model.state_dict().values(), ref.state_dict().values()))})
    sub.close()
    return results


# -- load_weights (vLLM / SGLang's interface) -------------------------------------------------------------------
def load_weights_subscriber(rank, world, addr, versions):
    """The subscriber hands full Hugging Face tensors to a ``load_weights(iterable of (name, tensor))``
    callable: here a module's own function that copies by name, as vLLM's ``model.load_weights`` does."""
    from unickpt import Mapping
    from unickpt.megatron.hf import llama_rules

    model = tiny_llama(1)
    calls = []

    def load_weights(weights):
        params = dict(model.named_parameters())
        n = 0
        for name, t in weights:
            params[name].data.copy_(t)
            n += 1
        calls.append(n)

    template = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    sub = Subscriber(template, addr, mapping=Mapping(llama_rules(HEADS, GROUPS, HEAD_DIM, to="hf")),
                     load_weights=load_weights)
    results = []
    for _ in range(versions):
        rep = sub.update(timeout_s=120)
        ref = _hf_version(rep.version)
        results.append({"version": rep.version, "calls": list(calls),
                        "params_equal": all(torch.equal(model.state_dict()[k], ref[k]) for k in ref)})
    sub.close()
    return results


# -- failures: a late subscriber, a corrupted message, a trainer rank dying mid-publish ---------------------------
def _plain_state(version: int, rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(100)
    w = torch.randn(64, 32, generator=g).bfloat16()
    b = torch.randn(32, generator=g).bfloat16()
    for v in range(2, version + 1):
        idx = torch.randperm(w.numel(), generator=g)[: w.numel() // 50]
        w.view(-1)[idx] += 1
    rows = 64 // world
    return {"w": unickpt.Shard(w[rank * rows:(rank + 1) * rows].clone(), (64, 32), offsets=(rank * rows, 0)),
            "b": b + version}


def _plain_full(version: int) -> dict:
    st = _plain_state(version, 0, 1)
    return {"w": st["w"].tensor, "b": st["b"]}


class CorruptingPublisher(Publisher):
    """Flips one byte of a message of version ``bad`` on the wire (after its checksum; first attempt only):
    the receiver's check must catch it and ask for a full resend."""

    bad = -1

    def _post(self, payload, dst):
        if self._seq_version == self.bad:
            self.bad = -1
            payload = payload.clone()
            payload[-1] ^= 0xFF
        return super()._post(payload, dst)

    def publish(self, version):
        self._seq_version = version
        return super().publish(version)


class DyingPublisher(Publisher):
    """Exits the process mid-publish of version ``die_at`` (after packing, before sending anything)."""

    die_at = -1

    def _send(self, version, held, report):
        if version == self.die_at:
            self._pack(self._pairs[0], self._items(self._pairs[0], held))
            os._exit(3)
        return super()._send(version, held, report)


def late_trainer(rank, world, addr, versions, corrupt_at):
    state = {}
    pub = CorruptingPublisher(lambda: state, addr, delta=True)
    pub.bad = corrupt_at if rank == 0 else -1  # one message of the version is corrupted
    reports = []
    for v in range(1, versions + 1):
        state.clear()
        state.update(_plain_state(v, rank, world))
        if v == 4:  # the subscriber joins only now: versions 1-3 reached nobody
            while pub.store.add("test/subscriber_started", 0) == 0:
                time.sleep(0.05)
            rep = publish_when_joined(pub, v)
        else:
            rep = pub.publish(v)
        reports.append(vars(rep).copy())
        if v == 3 and rank == 0:
            pub.store.add("test/three_published", 1)
    pub.close()
    return reports


def late_subscriber(rank, world, addr, versions_expected):
    import torch.distributed as dist

    store = dist.TCPStore(addr.split(":")[0], int(addr.split(":")[1]), None, False,
                          wait_for_workers=False)
    while store.add("test/three_published", 0) == 0:
        time.sleep(0.05)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    m.b = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
    sub = Subscriber(m, addr)
    store.add("test/subscriber_started", 1)
    results = []
    for _ in range(versions_expected):
        rep = sub.update(timeout_s=120)
        ref = _plain_full(rep.version)
        results.append({"version": rep.version, "report": vars(rep).copy(),
                        "equal": torch.equal(m.w, ref["w"]) and torch.equal(m.b, ref["b"])})
    sub.close()
    return results


def dying_trainer(rank, world, addr):
    state = {}
    pub = DyingPublisher(lambda: state, addr)
    pub.die_at = 2 if rank == 1 else -1
    state.update(_plain_state(1, rank, world))
    publish_when_joined(pub, 1)
    state.clear()
    state.update(_plain_state(2, rank, world))
    try:  # the training ranks' agreement finds rank 1 gone: raised (the training job itself is broken)
        error = pub.publish(2).error
    except unickpt.SyncError as e:
        error = str(e)
    while pub.store.add("test/subscriber_done", 0) == 0:  # rank 0 hosts the rendezvous store: stay up
        time.sleep(0.05)
    return {"error": error}


def dying_subscriber(rank, world, addr):
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    m.b = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
    sub = Subscriber(m, addr, timeout_s=60)
    first = sub.update().version
    error = None
    try:
        sub.receive()
    except unickpt.SyncError as e:
        error = str(e)
    ref = _plain_full(1)
    kept = torch.equal(m.w, ref["w"]) and torch.equal(m.b, ref["b"])
    try:  # the next receive joins a new generation; no trainer claims it
        sub.receive(timeout_s=2)
        again = "received"
    except TimeoutError as e:
        again = f"TimeoutError: {e}"
    try:
        sub.apply()
        staged = "applied"
    except unickpt.SyncError as e:
        staged = str(e)
    sub.store.add("test/subscriber_done", 1)
    return {"first": first, "error": error, "kept_version_1": kept, "version": sub.version, "again": again,
            "apply": staged}


# -- the inference side's mistakes do not stop training; tied embeddings ----------------------------------------
def mismatch_trainer(rank, world, addr, strict):
    pub = Publisher({"w": torch.zeros(8, 4, dtype=torch.bfloat16)}, addr, strict=strict)
    deadline, out = time.time() + 60, {}
    try:
        while time.time() < deadline:
            rep = pub.publish(1)
            if rep.error:
                out["error"] = rep.error
                out["after"] = [vars(pub.publish(v)).copy() for v in (2, 3)]  # training goes on
                break
            time.sleep(0.1)
    except unickpt.StateMismatchError as e:
        out["raised"] = str(e)
    pub.close()
    return out


def mismatch_subscriber(rank, world, addr):
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(8, 5, dtype=torch.bfloat16))
    sub = Subscriber(m, addr, timeout_s=60)
    try:
        sub.receive()
        return "received"
    except unickpt.StateMismatchError as e:
        return str(e)
    finally:
        sub.close()


def tied_trainer(rank, world, addr, tie):
    model = tiny_llama(0, tie=tie)
    with Publisher(model, addr, strict=False) as pub:
        rep = publish_when_joined(pub, 1)
        return {"error": rep.error, "bytes": rep.bytes_sent, "sd": _digests(model),
                "sizes": {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}}


def tied_subscriber(rank, world, addr, tie):
    model = tiny_llama(1, tie=tie)
    with Subscriber(model, addr, timeout_s=60) as sub:
        try:
            sub.update()
        except unickpt.StateMismatchError as e:
            return {"error": str(e)}
        return {"error": None, "sd": _digests(model),
                "tied": model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()}


def _digests(model) -> dict:
    """Per tensor, a digest of its bytes (tensors themselves do not travel back from a worker that exits)."""
    import hashlib

    return {k: hashlib.sha256(v.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in model.state_dict().items()}


def closing_trainer(rank, world, addr):
    state = {"w": unickpt.Shard(torch.full((4, 8), float(rank)), (8, 8), offsets=(4 * rank, 0))}
    pub = Publisher(state, addr)
    first = publish_when_joined(pub, 1)
    later = [pub.publish(v) for v in (2, 3)]  # the inference job closes while these are on their way
    pub.close()
    return {"first": first.subscribers, "later": [(r.subscribers, r.error) for r in later]}


def closing_subscriber(rank, world, addr):
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(8, 8))
    sub = Subscriber(m, addr, timeout_s=60)
    version = sub.update().version
    sub.close()
    return version


class RejectedPublisher(Publisher):
    """Corrupts, on every attempt, the messages of version ``bad`` to inference rank ``victim``: that rank's
    checksum fails twice (full resend included)."""

    bad, victim = -1, -1

    def _post(self, payload, dst):
        if self._seq_version == self.bad and dst == self.world + self.victim:
            payload = payload.clone()
            payload[0] ^= 0xFF
        return super()._post(payload, dst)

    def publish(self, version):
        self._seq_version = version
        return super().publish(version)


def rejected_trainer(rank, world, addr):
    state = {}
    pub = RejectedPublisher(lambda: state, addr)
    pub.bad, pub.victim = 2, 1
    reports = {}
    for v in (1, 2, 3):
        state.clear()
        state.update(_plain_state(v, rank, world))
        reports[v] = vars(publish_when_joined(pub, v) if v != 2 else pub.publish(v)).copy()
    while pub.store.add("test/rejected_checked", 0) < 2:  # both inference ranks checked version 3
        time.sleep(0.05)
    store = pub.store
    pub.close()  # marks the generation abandoned: the inference ranks must not wait for version 4
    while rank == 0 and store.add("test/rejected_done", 0) < 2:  # rank 0 hosts the store: stay up
        time.sleep(0.05)
    return reports


def rejected_subscriber(rank, world, addr):
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(64, 32, dtype=torch.bfloat16))
    m.b = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16))
    sub = Subscriber(m, addr, timeout_s=60)
    out = {"first": sub.update().version}
    try:
        sub.receive()
        out["second"] = "received"
    except unickpt.SyncError as e:
        out["second"] = str(e)
    ref = _plain_full(1)
    out["kept_1"] = torch.equal(m.w, ref["w"]) and torch.equal(m.b, ref["b"])
    rep = sub.update()  # joins again: a full version
    ref = _plain_full(3)
    out["third"] = (rep.version, rep.full_pairs, rep.delta_pairs, torch.equal(m.w, ref["w"]) and torch.equal(m.b, ref["b"]))
    sub.store.add("test/rejected_checked", 1)
    t = time.perf_counter()
    try:
        sub.receive(timeout_s=50)
        out["after_close"] = "received"
    except unickpt.SyncError as e:
        out["after_close"] = str(e)
    out["after_close_s"] = time.perf_counter() - t
    sub.store.add("test/rejected_done", 1)
    return out
