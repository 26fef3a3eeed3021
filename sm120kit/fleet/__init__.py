"""A fleet: several supervised sglang servers behind sglang's own router."""
