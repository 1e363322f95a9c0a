"""The models: HF adapters with their KV caches and rollback, loading by name, quantisation, packing."""
