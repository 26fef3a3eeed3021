"""sm120kit: patch and launch sglang on SM120 nodes."""

__version__ = "0.1.0"
