"""Checkpoint tiers (docs/tiers.md): this rank's newest steps in host shared memory (tier 0), a copy of
them in the shared memory of a rank on another node (tier 1), the persistent checkpoints (tier 2);
recovery from the nearest tier that still has every shard; a persistent save on a preemption notice.

Modules: :mod:`.node_dirs` (the memory directory of a node), :mod:`.placement` (which rank holds whose
copy), :mod:`.peer` (the background peer copies), :mod:`.recovery` (restart from the tiers),
:mod:`.signals` (preemption notices), :mod:`.agreement` (the per-step all-reduce of the watermarks),
:mod:`.manager` (:class:`~unickpt.tiers.manager.Tiers`: one checkpointer's tiers).
:class:`~unickpt.Checkpointer` uses them.
Submodules are imported by name; this package imports nothing.
"""
