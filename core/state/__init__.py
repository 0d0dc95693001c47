"""The caller's state: what a state may hold (:mod:`.leaves`: ``Shard``, ``PerRank``; :mod:`.rng`:
``RNGState``), and how a nested state becomes flat ``fqn -> leaf`` maps and back (:mod:`.flat`),
with plain values as tagged JSON (:mod:`.codec`). The first layer a save passes through and the last
of a load. Submodules are imported by name; this package imports nothing."""
