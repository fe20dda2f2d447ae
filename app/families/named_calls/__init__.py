"""Families whose calls name the function in a header, the arguments JSON after it."""
