"""Model implementations and their registry."""
