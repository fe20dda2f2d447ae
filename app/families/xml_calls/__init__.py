"""Families whose calls hold their arguments as elements with text values (XML parameters,
arg_key / arg_value, invoke / parameter)."""
