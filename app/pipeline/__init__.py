"""The typed request pipeline shared by every wire format (see ``pipeline``)."""
