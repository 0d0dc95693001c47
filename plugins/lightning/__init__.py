"""unickpt plugin for lightning (not built yet: see the project issues)."""

__all__: list[str] = []
