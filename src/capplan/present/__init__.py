"""Presentation: the show tables and the pictures (plan grids, simulate bars, optimize curve)."""
