"""API access for the rest of the agent: plain JSON over an HTTP client of its own (no `kubernetes` package)."""
