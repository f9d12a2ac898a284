"""CLI subcommands, one module each (see agent.cli)."""
