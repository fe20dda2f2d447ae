"""Families whose calls are JSON call objects: in tags, in a list, in lines, or bare."""
