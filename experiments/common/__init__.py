"""Shared by every command: human units, markdown tables, statistics over seeds (no servetwin imports)."""
