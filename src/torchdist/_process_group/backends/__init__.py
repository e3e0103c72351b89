"""Concrete backends; each module registers nothing itself (see ``..registry``)."""
