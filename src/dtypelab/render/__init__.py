"""Presentation: tables, Markdown, HTML and JSON. Renderers read only result records."""
