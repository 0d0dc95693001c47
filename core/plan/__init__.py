"""Planning, pure and deterministic (no I/O, no process group): every rank derives the same plan
from the same gathered inputs. Save: who writes which chunk where (:mod:`.save_plan`: replicas
written once, balanced by :mod:`.balance`; irregular shards merged by :mod:`.merge`; files laid out
as a byte stream by :mod:`.stream`). Load: who reads which stored bytes (:mod:`.read_plan`:
zero-redundancy reads). Both are cached per layout (:mod:`.cache`). Submodules are imported by
name; this package imports nothing."""
