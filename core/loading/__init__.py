"""The load path: :class:`~unickpt.loading.loader.Loader` orchestrates a collective load (checks,
needs, the zero-redundancy read plan, reads and redistribution, in-place copies); :mod:`.targets`
says what each rank needs, :mod:`.exchange` runs the reads and transfers, :mod:`.reads` reads,
verifies and copies bytes, :mod:`.from_dcp` migrates DCP directories. Submodules are imported by name;
this package imports nothing."""
