"""The package version, in a module of its own so that any part can read it without importing the
public API (``ampwatch/__init__.py``) and so without an import that runs back up the package."""
__version__ = "0.1.0"
