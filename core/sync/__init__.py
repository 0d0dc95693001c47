"""Live weight sync: a training job's weights to an inference job's layout, in memory, each version.

For RL post-training (PPO, GRPO), where the rollout engine needs the trainer's new weights after every
optimizer step. The transfer plan is the engine's read plan (:mod:`unickpt.plan.transfer`): every training
rank sends the byte ranges it holds straight to the inference ranks that need them (no gather on one
rank), each byte once per inference rank, replicas balanced over their holders, with the mapping rules
of cross-framework loads (:class:`~unickpt.Mapping`: Megatron -> Hugging Face) applied piece by piece.
The plan is computed once per pair of layouts and reused for every version; a delta mode sends only the
words that changed. docs/sync.md has the design, the protocol and the numbers.

Training job (every rank)::

    pub = unickpt.sync.Publisher(model, "trainer-0:29600", dtype=torch.bfloat16, delta=True)
    for step in ...:
        train_step()
        pub.publish(step)

Inference job (every rank)::

    sub = unickpt.sync.Subscriber(model, "trainer-0:29600")
    while True:
        sub.update()              # receive (into staging buffers) + apply (under sub.lock)
        with sub.lock:
            generate(model)

Modules: :mod:`~unickpt.sync.group` (rendezvous, generations, the pair group), :mod:`~unickpt.sync.tensors`
(what each side holds), :mod:`~unickpt.sync.wire` (messages, delta, checksums),
:mod:`~unickpt.sync.publisher`, :mod:`~unickpt.sync.subscriber`.
"""
from __future__ import annotations

from .publisher import Publisher, PublishReport
from .subscriber import ReceiveReport, Subscriber

__all__ = ["Publisher", "PublishReport", "Subscriber", "ReceiveReport"]
