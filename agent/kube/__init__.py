"""The only package that imports the `kubernetes` client: API access for the rest of the agent."""
