"""Running sglang: `sm120kit serve` (command: a lock per profile, the preflight, then the
supervisor) and `sm120kit ps`. The supervisor carries out what its state machine decides
(supervisor over machine) through seams it can be tested without (host: processes, ports,
GPUs, signals; probe; clock). Beside it: procs (process trees), progress and diagnose
(reading sglang's log), rundir and status (the run's record, which `ps` reads). The GPUs are
read through NVML by sm120kit.node.nvml (host's read_gpus)."""
