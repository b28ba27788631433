"""The version of harpjax (read by ``setup.py`` and stamped on cached profiles)."""

__version__ = "0.1.0"
