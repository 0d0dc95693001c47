"""The ``unickpt`` command and what it runs, one process, no process group: ``inspect``, ``ls``,
``verify`` (:mod:`.verify`), ``diff`` (:mod:`.diff`), ``export`` to Hugging Face layouts
(:mod:`.export`), ``import`` from other formats (:mod:`.importers`), ``rm`` / ``prune`` (through
:mod:`unickpt.lifecycle`); :class:`~unickpt.tools.reader.CheckpointReader` reads a checkpoint tensor
by tensor. Submodules are imported by name; this package imports nothing."""
