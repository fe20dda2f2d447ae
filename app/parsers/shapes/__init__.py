"""The call readers of the shapes other than JSON in tags (``app.families.syntax``), and
what their text arguments mean (``arg_types``)."""
