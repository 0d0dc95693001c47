"""The process-group side: unickpt's private gloo groups and collectives (:mod:`.comm`),
point-to-point transfers (:mod:`.p2p`), and one rank's failure raised on every rank
(:mod:`.failures`). Submodules are imported by name; this package imports nothing."""
