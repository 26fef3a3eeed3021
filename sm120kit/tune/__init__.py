"""tune-moe: fused-MoE kernel configs for the installed sglang, searched only among tiles that
fit sm_120, timed on the node's GPUs and installed where sglang looks, as tracked changes."""
