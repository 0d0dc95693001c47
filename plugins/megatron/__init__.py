"""unickpt plugin for megatron (not built yet: see the project issues)."""

__all__: list[str] = []
