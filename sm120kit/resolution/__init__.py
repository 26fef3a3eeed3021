"""What sglang will run: the installed release's own argument resolution, run in the
target's interpreter with the node's capability presented (probe.py, run.py), read into
the slots a kernel table speaks of (slots.py), and judged against that table (judge.py)."""
