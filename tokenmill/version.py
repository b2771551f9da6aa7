"""The package version (a module of its own, so that code inside the package need not import tokenmill/__init__)."""

__version__ = "0.1.0"
