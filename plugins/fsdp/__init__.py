"""unickpt plugin for fsdp (not built yet: see the project issues)."""

__all__: list[str] = []
