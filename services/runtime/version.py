"""The installed moemesh version (what `/version` and the root package report)."""

from importlib import metadata

try:
    VERSION = metadata.version("moemesh")
except metadata.PackageNotFoundError:  # a source tree without an install
    VERSION = "0.0.0+unknown"
