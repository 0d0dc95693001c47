"""The caller's state: what a state may hold (:mod:`.leaves`: ``Shard``, ``PerRank``; :mod:`.rng`:
``RNGState``), and how a nested state becomes flat ``fqn -> leaf`` maps and back (:mod:`.flat`),
with plain values as tagged JSON (:mod:`.codec`). The first layer a save passes through and the last
of a load. Submodules are imported by name; this package imports nothing."""
from .._compat import deprecated_getattr as _deprecated

# unickpt 0.1's module ``unickpt.state`` (deprecated names)
__getattr__ = _deprecated("unickpt.state", ("unickpt.state.flat",),
                          frozenset({"flatten", "saved_leaves", "optimizers_untouched", "sharded_tensor_shard",
                                     "FlatState", "TensorLeaf", "dtensor_box", "check_leaf_fits", "local_nbytes"}))
