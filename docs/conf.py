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

# fairscale, Lightning and accelerate are optional at runtime; the docs must build
# without them (flatview.integrations.lightning imports Lightning when imported).
autodoc_mock_imports = ["fairscale", "lightning", "pytorch_lightning", "accelerate"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"

napoleon_google_docstring = True
napoleon_numpy_docstring = True

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "flatview"
