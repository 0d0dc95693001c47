"""The on-disk format (version 1; docs/format.md): what a checkpoint directory holds
(:mod:`.files`), its index ``metadata.json`` (:mod:`.metadata`), checksums (:mod:`.integrity`) and
dtype names (:mod:`.dtypes`). Submodules are imported by name; this package imports nothing."""
