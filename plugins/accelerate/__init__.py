"""unickpt plugin for accelerate (not built yet: see the project issues)."""

__all__: list[str] = []
