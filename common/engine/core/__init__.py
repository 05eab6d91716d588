"""The engine's policy in pure Python: block manager and prefix cache, scheduler, sequences, sampling settings (no torch)."""
