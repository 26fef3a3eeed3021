"""What the tests share as code: helpers a test imports by name (`from support.sites import
install`), never fixtures. Fixtures and hooks live in conftest.py files, which no test imports
(tests/test_truth_suite.py keeps it so).

- paths:          where the checkout's test fixtures are
- sites:          real sglang / flashinfer releases, as wheels and unpacked into site directories
- patch_cases:    a shipped patch on every release in its declared range (the patch tests' harness)
- tree:           a directory's files and bytes, to say "nothing changed"
- cli:            the CLI run in-process
- clock:          a fake clock for serve's and the fleet's state machines
- http_server:    an in-process HTTP server that stops at once
- standin:        `sm120kit serve` (and a fleet) against the sglang stand-in, in processes of their own
- serve:          what serve's tests share: failure lines, a serving environment's `ps`
- node:           a node as doctor reads it (/proc and /sys trees, NVML documents, check inputs)
- tune:           the Kimi K2 shapes and the MoE releases tune-moe's tests share
- process_scope:  the test run's process scans see only its own descendants
- fast_tier:      what the fast tier's guard watches
"""
