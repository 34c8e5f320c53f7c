"""The agent's tools: one registry (registry.py), each tool defined once with its spec and how it runs."""
