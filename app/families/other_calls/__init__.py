"""Families with a call syntax of their own: Python calls, Gemma 4's objects, Harmony channels."""
