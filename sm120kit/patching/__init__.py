"""The patch engine: declared patches (spec), discovery (registry), state (ledger), and
plan / apply / verify / revert (engine)."""
