"""The save path: :class:`~unickpt.saving.saver.Saver` runs a group's saves (snapshot -> plan agreement
-> staging -> drain -> commit); :mod:`.snapshot` is the caller's part, :mod:`.plan_agreement` the plan
agreement, :mod:`.replicas` the replica check, :mod:`.pipeline` staging and merge transfers into the
rings of :mod:`.staging`, :mod:`.drain` checksums and writes, :mod:`.upload` the two-tier copy,
:mod:`.commit` the commit. Submodules are imported by name; this package imports nothing (the writer
process imports :mod:`.drain` without torch)."""
