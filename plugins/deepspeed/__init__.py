"""unickpt plugin for deepspeed (not built yet: see the project issues)."""

__all__: list[str] = []
