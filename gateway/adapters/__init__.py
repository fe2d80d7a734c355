"""Tenant-owned LoRA adapters on the gateway side: the hot-path lookup cache, and the
operations the admin and tenant routers share (register, load, unload, delete, residency).

Rows live in `tenancy.adapters`; engines load adapters through `Deployment.load_adapter`.
"""
