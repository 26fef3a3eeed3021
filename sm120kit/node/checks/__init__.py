"""The checks, one small function each, grouped by what they read: the GPUs (NVML), the
kernel and its limits (/proc, /sys), the software (the Python environment, the disk), the
patches, and what a server start needs (API key, stale processes, ports)."""
