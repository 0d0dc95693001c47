"""Live weight sync for RL-style post-training: an FSDP2 trainer and a separate "rollout" job that
generates with the Hugging Face model between weight updates (docs/sync.md).

    python examples/weight_sync.py [--trainers 2] [--steps 4]

Two jobs, each with its own ``torch.distributed`` world (gloo, CPU), launched here from one script for
convenience; they share nothing but the rendezvous address:

- the trainer (2-4 processes): a small random Llama under FSDP2, fp32, AdamW; after each step it
  publishes its weights in bf16 (``unickpt.sync.Publisher(..., delta=True)``);
- the rollout job (2 processes, each a whole bf16 model, as data-parallel rollout replicas): before each
  batch of generations it takes the newest version (``Subscriber.update``) and generates under the
  subscriber's lock, so a generation never runs on half-updated weights.

After each update the rollout job checks that its weights equal, bitwise, the trainer's gathered full
state of that step (written by the trainer's rank 0 for this check only), and prints what it generated.
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import socket
import tempfile

import torch

PROMPT = torch.tensor([[1, 5, 9, 14, 3]])


def _model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(dtype)


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(state[k].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def trainer(rank: int, world: int, addr: str, steps: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unickpt.sync import Publisher

    dist.init_process_group("gloo", init_method=f"file://{tmp}/trainer", rank=rank, world_size=world)
    model = _model(torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(rank))
    with Publisher(model, addr, dtype=torch.bfloat16, delta=True) as pub:
        for step in range(1, steps + 1):
            loss = model(data, labels=data).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:  # for the rollout job's check only
                with open(os.path.join(tmp, f"digest_{step}"), "w") as f:
                    f.write(_digest({k: v.to(torch.bfloat16) for k, v in full.items()}))
            dist.barrier()
            while True:  # the rollout job may still be starting: a publish with no subscriber sends nothing
                rep = pub.publish(step)
                if rep.subscribers:
                    break
            if rank == 0:
                print(f"[trainer] step {step}: loss {loss.item():.4f}; published {rep.bytes_sent / 1e6:.2f} MB "
                      f"of {rep.full_bytes / 1e6:.2f} MB in {rep.seconds * 1e3:.1f} ms "
                      f"({'delta' if rep.delta_pairs else 'full'})", flush=True)
    dist.destroy_process_group()


def rollout(rank: int, world: int, addr: str, steps: int, tmp: str) -> None:
    import torch.distributed as dist

    from unickpt.sync import Subscriber

    dist.init_process_group("gloo", init_method=f"file://{tmp}/rollout", rank=rank, world_size=world)
    model = _model(torch.bfloat16).eval()
    with Subscriber(model, addr) as sub:
        for _ in range(steps):
            rep = sub.update()
            with sub.lock, torch.no_grad():
                out = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
                same = _digest(model.state_dict()) == open(os.path.join(tmp, f"digest_{rep.version}")).read()
            if not same:
                raise SystemExit(f"rollout rank {rank}: version {rep.version} differs from the trainer's full state")
            print(f"[rollout {rank}] version {rep.version}: {rep.bytes_received / 1e6:.2f} MB received in "
                  f"{rep.seconds * 1e3:.1f} ms, weights bitwise equal to the trainer's; generated "
                  f"{out[0, PROMPT.shape[1]:].tolist()}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trainers", type=int, default=2, choices=(2, 3, 4))
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    tmp = tempfile.mkdtemp(prefix="unickpt-weight-sync-")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=trainer, args=(r, a.trainers, addr, a.steps, tmp)) for r in range(a.trainers)]
    procs += [ctx.Process(target=rollout, args=(r, 2, addr, a.steps, tmp)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise SystemExit(f"a process failed (exit codes {bad})")
    print("weight sync example: OK")


if __name__ == "__main__":
    main()
