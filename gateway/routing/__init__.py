"""Where each request goes: policies over deployments, health, and fallbacks."""
