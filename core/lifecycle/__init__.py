"""The lifecycle of checkpoints on storage: the rules of one checkpoint directory (commit marker,
writer record, replace, remove: :mod:`.directory`) and of a root of numbered checkpoints (``latest``,
retention, pruning: :mod:`.root`). Used by the save (its target guard), the Checkpointer, the tools
and the framework plugins, so that every layout follows the same rules. Submodules are imported by
name; this package imports nothing."""
