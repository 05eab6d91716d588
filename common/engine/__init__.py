"""The engine mechanism: LLMEngine, both model runners, the sampler, host-to-device uploads and the engine's config (imports torch)."""
