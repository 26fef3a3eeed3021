"""The node as every command sees it: one snapshot (NVML read once, /proc and /sys, the
environment, the Python environment), one Check type with a Status, and one registry of
checks, of which serve's preflight, doctor and bench each run the subset they need."""
