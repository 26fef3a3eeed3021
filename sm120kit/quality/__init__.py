"""`sm120kit smoke`: is a running sglang server answering right? Generated tasks with one
checkable answer (tasks), garbage detectors (detectors), the same greedy prompts alone and
inside a burst of concurrent requests, and prompt logprobs against a recorded reference
(baseline), sent through sglang's native /generate (client); what a run is asked (options),
how each check judges the replies (checks), what it found (smoke_report); command runs them
into one SmokeReport, render prints it."""
