"""Maintenance scripts (not used at run time)."""
