"""Sphinx configuration for flatview's docs."""

project = "flatview"
author = "flatview contributors"
copyright = "flatview contributors"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# fairscale is optional at runtime; the docs must build without it.
autodoc_mock_imports = ["fairscale"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"

napoleon_google_docstring = True
napoleon_numpy_docstring = True

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "flatview"
