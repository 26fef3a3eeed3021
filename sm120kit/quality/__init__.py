"""`sm120kit smoke`: is a running sglang server answering right? Generated tasks with one
checkable answer (tasks), garbage detectors (detectors), the same greedy prompts alone and
inside a burst of concurrent requests, and prompt logprobs against a recorded reference
(baseline), sent through sglang's native /generate (client); command runs them into one
SmokeReport, render prints it."""
