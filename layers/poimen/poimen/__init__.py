"""Poimen admission: admits workflow runs exactly once at the HTTP boundary."""
