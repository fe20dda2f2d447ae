"""The dashboard: a static page served by Tandem itself, its event stream, its buttons."""
