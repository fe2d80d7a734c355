"""Tenancy: tenants, plans, API keys, admin keys and usage records ("who may do what").

Submodules are imported explicitly (`tenancy.service`, `tenancy.keys`, ...); this package
imports nothing at load time so that light users (the CLI, the limiter) stay light.
"""
