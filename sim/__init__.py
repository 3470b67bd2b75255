"""Simulated engines, the LAYOUT.md transfer oracle and the demo."""
