"""The patch engine: declared patches (spec, registry), the pure rewrite step (transform),
planning (verdicts, planning), writing (apply, writing, transaction, ledger) and revert."""
