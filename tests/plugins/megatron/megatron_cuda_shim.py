"""TEST-ONLY: lets megatron-core 0.16.1 run its checkpoint path on a CPU-only torch build.

megatron-core hard-codes CUDA calls there (framework-hooks.md §5.4):
``strategies/async_utils.py`` (``torch.cuda.current_device()`` as the device of the "is the async save
done" all-reduce, ``torch.cuda.synchronize()`` before forking the writer),
``strategies/fully_parallel.py`` (``torch.cuda.synchronize()``), ``strategies/state_dict_saver.py``.
On a build without CUDA this module makes ``synchronize`` and ``set_device`` no-ops and
``current_device()`` return ``"cpu"`` (it is only used as a ``device=`` argument on those paths).
It never touches a CUDA build, and it is imported only by the test fixtures, never by unickpt.
"""
import torch

if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
