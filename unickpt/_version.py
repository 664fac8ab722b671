"""The version of unickpt (a leaf: what records it in manifests need not import the package)."""

__version__ = "0.1.0"
