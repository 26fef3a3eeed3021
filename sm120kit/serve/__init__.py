"""Running sglang: failure diagnosis (the supervisor builds on it)."""
