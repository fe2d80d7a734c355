"""Everything that touches torch: the model, paged attention, KV pool, sampler, runner."""
